"""`ruvllm download | list | info | export` and ruvllm.loader.hub.

Downloads never reach huggingface.co: `_HubStandIn` below is a LOCAL STAND-IN for the Hugging Face
Hub API, an http.server in a thread that answers just the endpoints huggingface_hub's
snapshot_download uses (model info, the recursive tree listing, HEAD/GET on /resolve/ with the
ETag / X-Repo-Commit / Content-Length headers it checks), and 404s with the Hub's X-Error-Code
for unknown repositories and revisions. HF_ENDPOINT points huggingface_hub at it. It serves a
tiny random Llama saved by transformers plus the default model's tokenizer (exported with
`export --tokenizer-only`).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import huggingface_hub.constants
import pytest
import torch
from typer.testing import CliRunner, Result

from ruvllm.cli import main as cli_main
from ruvllm.errors import ModelNotFoundError, NotAModelError
from ruvllm.loader import hf_folder, iter_weights, load_model_config, load_tokenizer, resolve_model
from ruvllm.loader import hub, model_cache

if not any(c.name == "download" for c in cli_main.app.registered_commands):
    cli_main._register()

TINY_REPO = "ruvllm-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
runner = CliRunner()


def invoke(*args: str) -> Result:
    return runner.invoke(cli_main.app, list(args))


def assert_one_line_error(result: Result, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in needles:
        assert needle in lines[0], result.output


pytestmark = pytest.mark.usefixtures("wide_terminal")  # each message on one line


# ------------------------------------------------------------------ the local stand-in for the Hub


@dataclass
class _HubStandIn:
    url: str
    repos: dict[str, Path]
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)

    def gets(self, filename: str) -> int:
        return sum(1 for m, p in self.requests if m == "GET" and p.endswith(f"/resolve/{COMMIT}/{filename}"))


def _handler(hub_: _HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:  # keep test output quiet
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
            self.send_response(status)
            for k, v in {"Content-Length": str(len(data)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _json(self, status: int, obj: object, body: bool, **headers: str) -> None:
            self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **headers}, body)

        def _not_found(self, code: str, body: bool) -> None:
            self._json(404, {"error": code}, body, **{"X-Error-Code": code, "X-Error-Message": code})

        def _files(self, repo: str) -> dict[str, Path]:
            folder = hub_.repos[repo]
            return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub_.requests.append((self.command, path))
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
                repo, rev = m.groups()
                if repo not in hub_.repos:
                    return self._not_found("RepoNotFound", body)
                if rev not in ("main", COMMIT):
                    return self._not_found("RevisionNotFound", body)
                tree = [
                    {"type": "file", "path": name, "size": p.stat().st_size,
                     "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                    for name, p in self._files(repo).items()
                ]
                return self._json(200, tree, body)
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
                repo, rev = m.groups()
                if repo not in hub_.repos:
                    return self._not_found("RepoNotFound", body)
                if rev not in (None, "main", COMMIT):
                    return self._not_found("RevisionNotFound", body)
                siblings = [{"rfilename": name} for name in self._files(repo)]
                return self._json(200, {"id": repo, "sha": COMMIT, "private": False, "siblings": siblings}, body)
            if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                repo, rev, name = m.groups()
                if repo not in hub_.repos:
                    return self._not_found("RepoNotFound", body)
                if rev not in ("main", COMMIT):
                    return self._not_found("RevisionNotFound", body)
                file = self._files(repo).get(name)
                if file is None:
                    return self._not_found("EntryNotFound", body)
                data = file.read_bytes()
                headers = {"Content-Type": "application/octet-stream", "X-Repo-Commit": COMMIT,
                           "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
                return self._send(200, data, headers, body)
            return self._json(404, {"error": f"stand-in does not serve {path}"}, body)

    return Handler


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer, written by `export --tokenizer-only` into an existing empty dir."""
    out = tmp_path_factory.mktemp("tok") / "export"
    out.mkdir()  # an empty directory is an acceptable target
    result = invoke("export", "default", str(out), "--tokenizer-only")
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def tiny_repo(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("repo")
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)  # overwrites the tokenizer export's config.json
    (folder / "README.md").write_text("tiny random llama\n")
    (folder / "pytorch_model.bin").write_bytes(b"not read by ruvllm")
    return folder


@pytest.fixture(scope="module")
def hub_server(tiny_repo: Path) -> Iterator[_HubStandIn]:
    standin = _HubStandIn(url="", repos={TINY_REPO: tiny_repo, "HuggingFaceTB/SmolLM2-135M-Instruct": tiny_repo})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(standin))
    standin.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield standin
    server.shutdown()
    server.server_close()


def _point_hf_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    # huggingface_hub reads these once at import: set the module values too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)  # no real token sent


@pytest.fixture
def hub_env(hub_server: _HubStandIn, monkeypatch: pytest.MonkeyPatch) -> _HubStandIn:
    _point_hf_at(monkeypatch, hub_server.url)
    return hub_server


# ------------------------------------------------------------------ download, list, info on downloads


def test_download_list_info_and_load(hub_env: _HubStandIn, tiny_repo: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = invoke("download", TINY_REPO, "--cache-dir", str(cache))
    assert result.exit_code == 0, result.output
    folder = cache / "models" / "ruvllm-test--tiny-llama"
    assert f"downloaded {TINY_REPO}" in result.output and str(folder) in result.output
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "README.md" not in names and "pytorch_model.bin" not in names  # only what ruvllm reads
    assert not list((cache / "models").glob("*.partial"))

    # The folder is an ordinary model folder for the loader.
    src = resolve_model(folder)
    assert src.format == "hf"
    cfg = load_model_config(src)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.max_position_embeddings) == ("llama", 2, 16, 256)
    served = dict(iter_weights(resolve_model(tiny_repo), torch.float32))
    got = dict(iter_weights(src, torch.float32))
    assert served.keys() == got.keys() and all(torch.equal(served[k], got[k]) for k in served)
    assert model_cache.resolve_cli_model(TINY_REPO, cache) == str(folder)

    listed = invoke("list", "--downloaded", "--cache-dir", str(cache))
    assert listed.exit_code == 0 and TINY_REPO in listed.output
    listed_long = invoke("list", "--downloaded", "--long", "--cache-dir", str(cache))
    assert str(folder) in listed_long.output and COMMIT[:12] in listed_long.output
    [model] = model_cache.list_models(cache)
    assert (model.repo_id, model.path, model.commit) == (TINY_REPO, folder, COMMIT) and model.size_bytes > 3_000_000

    info = invoke("info", TINY_REPO, "--cache-dir", str(cache))
    assert info.exit_code == 0, info.output
    n_params = sum(t.numel() for t in got.values())
    for line in ("architecture:   llama", f"parameters:     {n_params / 1e3:.2f}k ({n_params:,})",
                 "context length: 256", "downloaded:     yes", "supported:      yes", "model.safetensors",
                 f"revision:       main ({COMMIT[:12]})"):
        assert line in info.output, info.output

    # Present: no network, says so. --force: fetched again.
    gets = hub_env.gets("model.safetensors")
    again = invoke("download", TINY_REPO, "--cache-dir", str(cache))
    assert again.exit_code == 0 and "already downloaded" in again.output
    assert hub_env.gets("model.safetensors") == gets
    forced = invoke("download", TINY_REPO, "--cache-dir", str(cache), "--force", "--revision", "main")
    assert forced.exit_code == 0 and f"downloaded {TINY_REPO}" in forced.output, forced.output
    assert hub_env.gets("model.safetensors") == gets + 1
    assert model_cache.is_downloaded(TINY_REPO, cache, revision=COMMIT[:10])


def test_download_alias_into_env_cache_dir(hub_env: _HubStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(tmp_path / "envcache"))
    assert invoke("download", "smollm2").exit_code == 0
    assert (tmp_path / "envcache" / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct" / "config.json").is_file()
    listed = invoke("list")
    row = next(line for line in listed.output.splitlines() if line.startswith("smollm2"))
    assert row.split()[-1] == "yes"
    info = invoke("info", "smollm2")
    assert "hub id:" in info.output and "HuggingFaceTB/SmolLM2-135M-Instruct" in info.output
    assert "downloaded:     yes" in info.output


def test_download_unknown_repo(hub_env: _HubStandIn, tmp_path: Path) -> None:
    result = invoke("download", "nobody/nothing", "--cache-dir", str(tmp_path))
    assert_one_line_error(result, "nobody/nothing", "not found")
    assert model_cache.list_models(tmp_path) == []


def test_download_unknown_revision(hub_env: _HubStandIn, tmp_path: Path) -> None:
    result = invoke("download", TINY_REPO, "--revision", "v9", "--cache-dir", str(tmp_path))
    assert_one_line_error(result, TINY_REPO, "revision 'v9' not found")


def test_download_unreachable_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _point_hf_at(monkeypatch, f"http://127.0.0.1:{port}")
    result = invoke("download", TINY_REPO, "--cache-dir", str(tmp_path))
    assert_one_line_error(result, TINY_REPO, "cannot reach the Hub", str(port))
    assert model_cache.list_models(tmp_path) == []


def test_download_rejects_names_that_are_not_hub_models(tmp_path: Path) -> None:
    assert_one_line_error(invoke("download", "default", "--cache-dir", str(tmp_path)), "embedded")
    assert_one_line_error(invoke("download", "not-a-repo", "--cache-dir", str(tmp_path)), "not a model alias")


def test_resolve_cli_model(tmp_path: Path) -> None:
    assert model_cache.resolve_cli_model(None, tmp_path) is None
    assert model_cache.resolve_cli_model("default", tmp_path) is None
    assert model_cache.resolve_cli_model(str(tmp_path), tmp_path) == str(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"model qwen is not downloaded; run `ruvllm download qwen`"):
        model_cache.resolve_cli_model("qwen", tmp_path)
    with pytest.raises(ModelNotFoundError, match="not downloaded"):
        model_cache.resolve_cli_model("Qwen/Qwen3-0.6B", tmp_path)
    with pytest.raises(ModelNotFoundError, match="no such file"):
        model_cache.resolve_cli_model(str(tmp_path / "missing"), tmp_path)


def test_cache_dir_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUVLLM_CACHE_DIR", raising=False)
    monkeypatch.setattr(model_cache.sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache.resolve_cache_dir() == tmp_path / "xdg" / "ruvllm"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert model_cache.resolve_cache_dir() == Path.home() / ".cache" / "ruvllm"
    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(tmp_path / "env"))
    assert model_cache.resolve_cache_dir() == tmp_path / "env"
    assert model_cache.resolve_cache_dir(tmp_path / "flag") == tmp_path / "flag"
    assert model_cache.model_dir("Qwen/Qwen2.5-0.5B-Instruct", tmp_path) == tmp_path / "models" / "Qwen--Qwen2.5-0.5B-Instruct"


# ------------------------------------------------------------------ list and info without downloads


def test_list_marks_aliases_and_default(tmp_path: Path) -> None:
    result = invoke("list", "--cache-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    assert "embedded" in rows["default"]
    for alias, known in model_cache.ALIASES.items():
        assert known.repo_id in rows[alias] and rows[alias].split()[-1] == "no"
    assert f"cache: {tmp_path}" in result.output
    long = invoke("list", "--long", "--cache-dir", str(tmp_path))
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in long.output and "MB" in long.output
    empty = invoke("list", "--downloaded", "--cache-dir", str(tmp_path))
    assert empty.exit_code == 0 and "no models downloaded" in empty.output


def test_info_default_model() -> None:
    result = invoke("info")
    assert result.exit_code == 0, result.output
    for line in ("model:          default", "format:         GGUF", "architecture:   llama", "supported:      yes",
                 "parameters:     134.52M (134,515,008)", "context length: 8192", "quantization:   Q4_1",
                 "SmolLM2-135M-Instruct.Q4_1.gguf", "disk use:"):
        assert line in result.output, result.output


# ------------------------------------------------------------------ info --quantization: the memory estimate

_LINEAR_GGUF = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")


def _default_model_bytes(method: str, group_size: int = 32) -> int:
    """Weight bytes of the default model loaded with `method`, worked out here from the GGUF tensor
    shapes: decoder linears packed (int8: a byte per weight + a 2-byte scale per row; int4, and the
    file's Q4_1 codes under auto: half a byte per weight + a 2-byte scale and a 2-byte zero per
    group), everything else dense; under auto the tied LM head is also a Q8_0 copy of the embeddings
    (a byte per weight + a 2-byte scale per 32)."""
    from gguf import GGMLQuantizationType

    from ruvllm.loader import gguf_file
    from ruvllm.loader.gguf_header import read_header

    elem = 2 if _computes_in_bf16() else 4
    total = 0
    for t in read_header(resolve_model(None).path).tensors:
        if t.name == gguf_file.ROPE_FREQS_TENSOR:
            continue
        numel, rows = t.n_elements, t.shape[0] if len(t.shape) == 2 else 0
        if method == "auto" and t.name == "token_embd.weight":
            total += elem * numel + numel + 2 * (numel // 32)
        elif not _LINEAR_GGUF.fullmatch(t.name) or method == "none":
            total += elem * numel
        elif method == "int8":
            total += numel + 2 * rows
        else:
            assert method in ("int4", "auto") and rows % 16 == 0 and t.tensor_type == GGMLQuantizationType.Q4_1
            total += numel // 2 + 4 * (numel // (32 if method == "auto" else group_size))
    return total


def _computes_in_bf16() -> bool:
    from ruvllm.dtypes import resolve_dtype

    return resolve_dtype("auto") == torch.bfloat16


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _estimate_line(output: str, key: str) -> str:
    line = next((line for line in output.splitlines() if line.startswith(key + ":")), None)
    assert line is not None, output
    return line[len(key) + 1:].strip()


@pytest.mark.parametrize("method", ["int8", "none", "auto", "int4"])
def test_info_quantization_estimate(method: str) -> None:
    plain = invoke("info")
    result = invoke("info", "-q", method)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(plain.output)  # the usual lines first, unchanged
    before = _estimate_line(result.output, "weights as loaded (auto)")
    after = _estimate_line(result.output, f"weights with {method}" + (" g32" if method == "int4" else ""))
    want_before, want_after = _default_model_bytes("auto"), _default_model_bytes(method)
    assert before.startswith(_mib(want_before) + " ("), result.output
    assert after.startswith(_mib(want_after) + " ("), result.output
    assert "120 int4 g32, 1 int8 g32" in before  # the file's Q4_1 codes, and the LM head as Q8_0
    if _computes_in_bf16():
        assert _mib(_default_model_bytes("none")) == "256.6 MiB"  # 2 bytes x 134,515,008 parameters
        assert _mib(_default_model_bytes("int4")) == "117.3 MiB"  # what the engine logs at load (docs/quantization.md)
    ratio = want_after / want_before
    change = "the same size" if method == "auto" else f"{ratio if ratio > 1 else 1 / ratio:.2f}x " + (
        "larger" if ratio > 1 else "smaller")
    assert change in after, (change, after)
    assert _estimate_line(result.output, "KV cache") == "unchanged by weight quantization"
    elem = 2 if _computes_in_bf16() else 4
    per_token = 2 * 30 * 3 * 64 * elem  # 2 (K, V) x layers x KV heads x head dim x bytes
    assert _estimate_line(result.output, "KV bytes per token").startswith(f"{per_token:,} (")
    tokens = (2**30 // (per_token * 16)) * 16  # whole 16-token blocks in the default 1 GiB
    assert _estimate_line(result.output, "KV tokens in 1 GiB").startswith(f"{tokens:,} ")
    tiered = _estimate_line(result.output, "KV tokens in 1 GiB, --kv-cache-dtype int8 / int4").split(" (")[0]
    int8_tokens, int4_tokens = (int(t.replace(",", "")) for t in tiered.split(" / "))
    assert int8_tokens >= 1.8 * tokens and int4_tokens >= 3 * tokens, (tokens, tiered)  # the floor


def test_info_quantization_int4_group_64() -> None:
    result = invoke("info", "-q", "int4", "--group-size", "64")
    assert result.exit_code == 0, result.output
    after = _estimate_line(result.output, "weights with int4 g64")
    assert after.startswith(_mib(_default_model_bytes("int4", 64)) + " ("), result.output
    assert "120 int4 g64" in after


def test_info_quantization_auto_matches_a_real_load() -> None:
    from ruvllm.config import QuantConfig
    from ruvllm.models.registry import build_model, weight_bytes
    from ruvllm.models.weight_plan import weight_plan

    src = resolve_model(None)
    plan = weight_plan(src, QuantConfig())
    weights = iter_weights(src, plan.dtype, keep_quantized=plan.keep_packed)
    model = build_model(load_model_config(src), weights, str(src.path), 16, plan.dtype, plan=plan)  # seconds
    loaded = weight_bytes(model)  # what EngineInfo.weight_bytes reports
    assert loaded == plan.total_bytes
    result = invoke("info", "-q", "auto")
    assert _estimate_line(result.output, "weights as loaded (auto)").startswith(_mib(loaded) + " ("), result.output
    assert loaded == _default_model_bytes("auto")


@pytest.mark.parametrize("method", ["none", "int8", "int4"])
def test_info_quantization_hf_folder_matches_a_real_load(tiny_repo: Path, method: str) -> None:
    from ruvllm.config import QuantConfig
    from ruvllm.dtypes import resolve_model_dtype
    from ruvllm.models.registry import build_model, weight_bytes

    result = invoke("info", str(tiny_repo), "-q", method, "--group-size", "32")
    if method == "int4":  # hidden size 16: no int4 group size divides it, and the load fails the same way
        assert_one_line_error(result, "int4 group size 32 does not divide the input size 16")
        return
    quant = QuantConfig(method)
    dtype = resolve_model_dtype("auto", quant)
    src = resolve_model(tiny_repo)
    model = build_model(load_model_config(src), iter_weights(src, dtype), str(src.path), 16, dtype, quant=quant)
    assert result.exit_code == 0, result.output
    after = _estimate_line(result.output, f"weights with {method}")
    assert after.startswith(_mib(weight_bytes(model)) + " ("), result.output
    assert ("8 int8" if method == "int8" else "8 dense") in after  # 2 layers x (qkv, o, gate_up, down)


def test_info_quantization_not_downloaded(tmp_path: Path) -> None:
    result = invoke("info", "qwen", "-q", "int8", "--cache-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "memory estimate: needs the model's files (not downloaded)" in result.output


def test_estimate_fuses_like_the_loader() -> None:
    """q/k/v pieces stored in different GGUF types (as in Q4_K_M files) become per-channel int8,
    as the loader fuses them (quant.plan.fuse_pieces)."""
    import dataclasses

    import torch

    from ruvllm.config import QuantConfig
    from ruvllm.models.weight_plan import file_tensors, plan_weights

    src = resolve_model(None)
    cfg, tensors = load_model_config(src), file_tensors(src)

    def estimate(tensors: list, quant: QuantConfig):
        return plan_weights(cfg, tensors, quant, torch.bfloat16, "x")

    def with_v0(packed: tuple[str, int] | None) -> list:
        return [dataclasses.replace(t, packed=packed) if t.name == "model.layers.0.self_attn.v_proj.weight" else t
                for t in tensors]

    auto = estimate(tensors, QuantConfig())
    mixed = estimate(with_v0(None), QuantConfig())  # e.g. a Q6_K attn_v
    rows, k = cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size
    int8_bytes, int4_bytes = rows * k + 2 * rows, rows * k // 2 + 4 * rows * k // 32
    assert mixed.total_bytes - auto.total_bytes == int8_bytes - int4_bytes
    assert mixed.linear_forms() == {"int4 g32": 119, "int8": 1, "int8 g32": 1}  # and the LM head
    assert mixed.weights["layers.0.qkv_proj.weight"].form == ("int8", 0)
    q8 = estimate(with_v0(("int8", 32)), QuantConfig())  # a Q8_0 attn_v
    assert q8.total_bytes == mixed.total_bytes and q8.linear_forms() == mixed.linear_forms()
    assert estimate(with_v0(("int8", 32)), QuantConfig("none")).total_bytes == \
        estimate(tensors, QuantConfig("none")).total_bytes  # dequantized: no packed pieces


def test_a_load_that_departs_from_its_plan_fails() -> None:
    """The loader checks each weight against the plan: a plan that expected float weights where the
    file hands over packed codes (here: a plan made as if nothing were packed) stops the load."""
    import dataclasses

    import torch

    from ruvllm.config import QuantConfig
    from ruvllm.models.registry import build_model
    from ruvllm.models.weight_plan import file_tensors, plan_weights

    src = resolve_model(None)
    cfg = load_model_config(src)
    floats = [dataclasses.replace(t, packed=None) for t in file_tensors(src)]
    plan = plan_weights(cfg, floats, QuantConfig(), torch.bfloat16, "x")
    assert not any(w.stored for w in plan.weights.values())
    plan = dataclasses.replace(plan, keep_packed=True)  # what the loader is then asked for
    # The embeddings come first in the file: Q8_0 codes, where the plan expected floats.
    expected = r"embed_tokens.weight arrived as \('int8', 32\), but the weight plan expected float"
    with pytest.raises(RuntimeError, match=expected):
        build_model(cfg, iter_weights(src, torch.bfloat16, keep_quantized=True), "x", 16, torch.bfloat16, plan=plan)


def test_info_quantization_bad_settings_are_one_line() -> None:
    assert_one_line_error(invoke("info", "-q", "bogus"), "bogus", "auto, none, bf16, f16, int8, int4")
    assert_one_line_error(invoke("info", "-q", "int4", "--group-size", "48"), "48")
    # 128 is a valid group size, but does not divide the 576 inputs of the default model's projections
    assert_one_line_error(invoke("info", "-q", "int4", "--group-size", "128"), "128", "576", "layers.0.")
    assert_one_line_error(invoke("info", "--group-size", "64"), "--quantization")


def test_realize_makes_the_planned_form_at_the_planned_bytes() -> None:
    """The plan (`info -q`, and the loader's WeightPlan) decides each form from shapes alone; `realize`
    (through final_form) must make exactly that form, of the bytes estimate_bytes counts, from every
    stored form: a realize that fell back to another form (int4 -> int8, say) would part them."""
    from ruvllm.config import QUANTIZATION_METHODS, QuantConfig
    from ruvllm.quant.plan import final_form, planned_form
    from ruvllm.quant.rtn import quantize_int4, quantize_int8
    from ruvllm.quant.weights import QuantizedWeight, estimate_bytes

    torch.manual_seed(0)
    forms = 0
    for rows in (64, 40):  # 40: not a multiple of 16, int4 falls back to int8
        w = torch.randn(rows, 128) * 0.05
        q8 = quantize_int8(w)
        q8_g32 = QuantizedWeight("int8", q8.codes, q8.scales[:, None].repeat(1, 4), None, 32)  # like GGUF Q8_0
        for stored in (w, quantize_int4(w, 32), q8_g32, q8):
            packed = (stored.kind, stored.group_size) if isinstance(stored, QuantizedWeight) else None
            for method in QUANTIZATION_METHODS:
                for group_size in (32, 64, 256):  # 256 does not divide 128
                    for dtype in (torch.float32, torch.bfloat16, torch.float16):
                        for name in ("layers.0.qkv_proj", "lm_head"):
                            cfg = QuantConfig(method, group_size)
                            try:
                                out = final_form(cfg, name, stored, dtype)
                            except ValueError as e:
                                with pytest.raises(ValueError, match=re.escape(str(e))):
                                    planned_form(cfg, name, packed, (rows, 128), dtype)
                                continue
                            kind, group = planned_form(cfg, name, packed, (rows, 128), dtype)
                            if isinstance(out, QuantizedWeight):
                                assert (out.kind, out.group_size) == (kind, group)
                                assert out.nbytes == estimate_bytes(kind, rows, 128, group)
                            else:
                                assert kind == "dense" and out.dtype == dtype
                            forms += 1
    assert forms > 500


def test_info_alias_not_downloaded(tmp_path: Path) -> None:
    result = invoke("info", "phi", "--cache-dir", str(tmp_path))
    assert result.exit_code == 1, result.output  # described, but an architecture we do not run
    for line in ("hub id:", "microsoft/Phi-3-mini-4k-instruct", "downloaded:   no", "architecture: phi3",
                 "supported:    no"):
        assert line in result.output, result.output


def test_missing_model_path_is_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "model.gguf")
    assert_one_line_error(invoke("info", missing), "no such file")
    assert_one_line_error(invoke("export", missing, str(tmp_path / "out")), "no such file")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ export


@pytest.fixture(scope="module")
def default_tokenizer() -> object:
    return load_tokenizer(resolve_model(None))  # built from GGUF metadata: seconds, so once


def test_export_tokenizer_only(tokenizer_dir: Path, default_tokenizer: object) -> None:
    from transformers import AutoTokenizer

    names = {p.name for p in tokenizer_dir.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith(".safetensors") for n in names)
    default = resolve_model(None)
    assert hf_folder.load_config(tokenizer_dir) == load_model_config(default)
    with pytest.raises(NotAModelError):  # config without weights is, by design, not a model
        resolve_model(tokenizer_dir)
    _assert_same_tokenizer(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True),
                           default_tokenizer)
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert "local_files_only" not in tok_config and tok_config["model_max_length"] == 8192


def _assert_same_tokenizer(got: object, want: object) -> None:
    messages = [{"role": "user", "content": "Hello, wörld! 12345"}]
    assert got.chat_template == want.chat_template  # type: ignore[attr-defined]
    assert got.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        want.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
    text = "Tokenizers should agree: naïve café, 3.14159, <|im_start|>"
    assert got(text)["input_ids"] == want(text)["input_ids"]  # type: ignore[operator]
    assert (got.bos_token, got.eos_token) == (want.bos_token, want.eos_token)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def full_export(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("full") / "smollm2-hf"
    result = invoke("export", "default", str(out))
    assert result.exit_code == 0, result.output
    yield out
    shutil.rmtree(out, ignore_errors=True)  # 540 MB: do not leave it to pytest's tmp retention


def test_export_full_round_trip(full_export: Path, default_tokenizer: object) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    default = resolve_model(None)
    assert {p.name for p in full_export.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    exported = resolve_model(full_export)
    assert exported.format == "hf"
    assert load_model_config(exported) == load_model_config(default)

    ours = dict(iter_weights(exported, torch.float32))
    assert "lm_head.weight" not in ours  # tied embeddings: not written
    hf_model = AutoModelForCausalLM.from_pretrained(str(full_export), dtype=torch.float32, local_files_only=True)
    state = hf_model.state_dict()
    for name, tensor in iter_weights(default, torch.float32):  # one reference tensor at a time
        assert torch.equal(ours.pop(name), tensor), name
        assert torch.equal(state[name], tensor), name
    assert not ours
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    del hf_model, state
    _assert_same_tokenizer(AutoTokenizer.from_pretrained(str(full_export), local_files_only=True),
                           default_tokenizer)


def test_export_refuses_non_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert_one_line_error(invoke("export", "default", str(tmp_path), "--tokenizer-only"), "not empty")
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    assert_one_line_error(invoke("export", "default", str(tmp_path / "keep.txt")), "not a directory")
    assert not list(tmp_path.glob(".*partial*"))


def test_download_patterns_pick_one_format() -> None:
    """Which files a download asks for, from the repository's file list (no network)."""
    st = hub._patterns("m", ["config.json", "model.safetensors", "consolidated.safetensors", "x.gguf"], None)
    assert "*.safetensors" in st and "tokenizer*" in st
    assert hub._patterns("m", ["README.md", "m-Q4_K_M.gguf"], None) == ["m-Q4_K_M.gguf"]
    with pytest.raises(hub.HubError, match="2 .gguf files; choose one with --gguf"):
        hub._patterns("m", ["a-Q4_0.gguf", "a-Q8_0.gguf"], None)
    assert hub._patterns("m", ["a-Q4_0.gguf", "a-Q8_0.gguf"], "a-Q8_0.gguf") == ["a-Q8_0.gguf"]
    with pytest.raises(hub.HubError, match="no safetensors or GGUF"):
        hub._patterns("m", ["config.json", "pytorch_model.bin"], None)
