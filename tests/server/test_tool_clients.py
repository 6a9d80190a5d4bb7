"""Third-party clients pointed at the server (the default model): `instructor` with a pydantic model
(its default mode: a named tool call, constrained by the tool's schema), and LangChain's
`ChatOpenAI.bind_tools` and `with_structured_output`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel, Field

from ruvllm import LLM
from tests.server.conftest import MODEL, RunningServer, start_server


@pytest.fixture(scope="module")
def server(_default_llm: LLM) -> Iterator[RunningServer]:
    """The model as a user gets it (packed 4-bit weights): what these tests check is the clients'
    round trip, not the fp32 reference's arithmetic, and a decode step costs 10 ms of CPU here rather
    than 35."""
    yield from start_server(_default_llm)


class City(BaseModel):
    name: str = Field(max_length=30)
    population: int = Field(ge=0)


def test_instructor_returns_the_pydantic_model(server: RunningServer) -> None:
    instructor = pytest.importorskip("instructor")
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0))
    city = client.chat.completions.create(model=MODEL, response_model=City, max_retries=0, max_tokens=80,
                                          temperature=0,
                                          messages=[{"role": "user", "content": "Name a big city and its population."}])
    assert isinstance(city, City) and city.name


def test_langchain_bind_tools_and_structured_output(server: RunningServer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="x", max_retries=0,
                                      temperature=0, max_tokens=80)

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"] and isinstance(msg.tool_calls[0]["args"]["city"], str)
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Name a big city and its population.")
        assert isinstance(city, City), method
