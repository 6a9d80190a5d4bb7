"""Third-party clients pointed at the server (the default model): `instructor` with a pydantic model
(its default mode: a named tool call, constrained by the tool's schema), and LangChain's
`ChatOpenAI.bind_tools` and `with_structured_output`."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL, RunningServer


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
