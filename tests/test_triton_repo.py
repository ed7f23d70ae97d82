"""`specrt triton`: the repository it writes, `--check` on it, and its Python model run outside tritonserver.

The model runs through tests/triton_stub (Triton's transport stood in for: tensors, responses, senders) on a real
engine over a real artifact; its tokens must equal a direct engine run of the same request.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specrt.artifact import ExportSettings
from specrt.cli import main
from specrt.exporter.export import export_artifact
from specrt.runtime.engine import Engine, Request
from specrt.runtime.prompts import encode_prompt
from specrt.runtime.sampling import SamplingParams
from specrt.errors import SpecrtError
from specrt.serve.triton.check import check_repository
from specrt.serve.triton.config import engine_settings
from specrt.serve.triton.repository import write_repository

pytest.importorskip("tritonclient.grpc.model_config_pb2")
FIXTURE = Path(__file__).parent / "fixtures" / "deepspec_dspark_tiny"
STUB = Path(__file__).parent / "triton_stub"
WORDS = [f"w{i}" for i in range(508)]
METHOD = dict(method="ngram", scheduler="fixed")  # the tiny DSpark head's drafts are all rejected


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> Path:
    """The tiny DSpark fixture with a word-level tokenizer, so both text and token-id prompts work."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    work = tmp_path_factory.mktemp("triton")
    model = Path(shutil.copytree(FIXTURE / "target", work / "model"))
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3,
                                      **{w: 4 + i for i, w in enumerate(WORDS)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return export_artifact(model, work / "art", ExportSettings(batch=4, max_seq=128, prefill_chunk=16, verify_len=5),
                           draft=FIXTURE / "draft", progress=False)


@pytest.fixture(scope="module")
def repo(art, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("repo") / "repo"
    write_repository(art, out, max_tokens=10, threads=1, **METHOD)
    return out


def _copy(repo: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(repo, tmp_path / "repo"))


# -- the repository and its check -----------------------------------------------------------------------


def test_layout(art, repo):
    names = sorted(p.name for p in repo.iterdir() if p.name != ".specrt-output.json")
    assert names == ["specrt", "specrt_dspark", "specrt_dspark_greedy", "specrt_target"]
    assert (repo / "specrt/1/model.py").read_text() == (
        Path(__file__).parents[1] / "serve/triton/model.py").read_text()
    assert (repo / "specrt/1/artifact/manifest.json").is_file()
    # the graphs' external weights sit beside each debugging model, hard-linked (same filesystem here)
    for name in names[1:]:
        assert (repo / name / "1/model.onnx").is_file()
        assert (repo / name / "1/weights.bin").stat().st_ino == (art / "weights.bin").stat().st_ino
    config = (repo / "specrt/config.pbtxt").read_text()
    assert "decoupled: true" in config and 'string_value: "ngram"' in config
    # the environment model.py adds for Triton's stub: this interpreter's, where specrt is importable
    env = json.loads((repo / "specrt/1/specrt_env.json").read_text())
    assert env["python"] == list(sys.version_info[:2]) and env["site"]
    assert any(Path(p, "specrt").exists() or list(Path(p).glob("__editable__*specrt*")) for p in env["site"])


def test_debug_model_loads_in_onnxruntime(repo):
    """A debugging model's folder is all ONNX Runtime needs (its weights resolve beside model.onnx)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(repo / "specrt_dspark/1/model.onnx"), providers=["CPUExecutionProvider"])
    assert "survival" in [o.name for o in session.get_outputs()]


def test_check_passes(repo):
    report = check_repository(repo)
    assert report["problems"] == []
    assert {m["name"]: m["ok"] for m in report["models"]} == {
        "specrt": True, "specrt_dspark": True, "specrt_dspark_greedy": True, "specrt_target": True}
    result = CliRunner().invoke(main, ["triton", "--check", str(repo)])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["triton", "--check", str(repo), "--json"])
    assert json.loads(result.stdout)["problems"] == []


def test_check_finds_problems(repo, tmp_path):
    bad = _copy(repo, tmp_path)
    target = bad / "specrt_target/config.pbtxt"
    text = target.read_text()
    target.write_text(text.replace('name: "position_ids"\n    data_type: TYPE_INT64',
                                   'name: "position_ids"\n    data_type: TYPE_INT32', 1))
    (bad / "specrt_dspark/config.pbtxt").write_text(
        (bad / "specrt_dspark/config.pbtxt").read_text().replace('name: "specrt_dspark"', 'name: "dspark"'))
    (bad / "specrt_dspark_greedy/1/weights.bin").unlink()
    spec = bad / "specrt/config.pbtxt"
    spec.write_text(spec.read_text().replace("decoupled: true", "decoupled: false"))
    (bad / "specrt/1/model.py").unlink()
    (bad / "extra").mkdir()
    (bad / "extra/config.pbtxt").write_text('name: "extra"\nplatform: "onnxruntime_onnx"\nbackend: "python"\n'
                                            "max_batch_size: 0\n")
    (bad / "broken").mkdir()
    (bad / "broken/config.pbtxt").write_text("name: 'broken'\nnot_a_field: 1\n")
    problems = check_repository(bad)["problems"]
    text = "\n".join(problems)
    assert "position_ids' is TYPE_INT32 in config.pbtxt, TYPE_INT64 in the graph" in text
    assert "specrt_dspark: config name 'dspark' differs from the folder name" in text
    assert "specrt_dspark_greedy/1/model.onnx: its external data weights.bin is missing" in text
    assert "specrt: the specrt model streams" in text
    assert "specrt/1/model.py: missing" in text
    assert "extra: platform 'onnxruntime_onnx' runs on backend 'onnxruntime', not 'python'" in text
    assert "extra: no version folder" in text
    assert "broken/config.pbtxt: not a valid Triton ModelConfig" in text
    result = CliRunner().invoke(main, ["triton", "--check", str(bad)])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[:len(problems)] == problems


@pytest.mark.parametrize("param, value, fragment", [
    ("method", "nonsense", "parameter method: 'nonsense' is not one of ar, ngram"),
    ("slots", "-5", "parameter slots: '-5' is not a whole number >= 1"),
    ("max_tokens", "abc", "parameter max_tokens: 'abc' is not a whole number >= 1"),
    ("scheduler", "fast", "parameter scheduler: 'fast' is not one of"),
    ("backend", "torch", "parameter backend: 'torch' is not one of ort, tensorrt"),
    ("artifact", "../../elsewhere", "must be a folder inside the model's version folder"),
])
def test_check_parses_the_specrt_parameters_as_model_py_does(repo, tmp_path, param, value, fragment):
    """--check once passed parameters model.py could not load: both now parse them with engine_settings."""
    import re

    bad = _copy(repo, tmp_path)
    spec = bad / "specrt/config.pbtxt"
    text, n = re.subn(rf'(key: "{param}"\s*value: {{ string_value: )"[^"]*"', rf'\1"{value}"', spec.read_text())
    assert n == 1, spec.read_text()
    spec.write_text(text)
    problems = check_repository(bad)["problems"]
    assert any(fragment in p and "model.py could not load" in p for p in problems), problems
    with pytest.raises(SpecrtError, match=re.escape(fragment)):
        engine_settings({param: value})


def test_writer_refuses_an_output_inside_the_artifact(art, tmp_path):
    """Each rerun used to copy the previous repository into the next one."""
    copy = Path(shutil.copytree(art, tmp_path / "art"))
    result = CliRunner().invoke(main, ["triton", str(copy), "--out", str(copy / "repo")])
    assert result.exit_code == 1 and "is inside the artifact" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (copy / "repo").exists()


def test_writer_refuses_links_that_leave_the_artifact(art, tmp_path):
    """A link to a host file would ship that file's content in the repository."""
    copy = Path(shutil.copytree(art, tmp_path / "art"))
    host = tmp_path / "host_secret.txt"
    host.write_text("secret")
    (copy / "notes.txt").symlink_to(host)
    result = CliRunner().invoke(main, ["triton", str(copy), "--out", str(tmp_path / "r")])
    assert result.exit_code == 1 and "notes.txt' leads outside the artifact" in result.output
    assert not (tmp_path / "r").exists()
    (copy / "notes.txt").unlink()
    (copy / "notes.txt").symlink_to(copy / "manifest.json")  # a link inside the artifact is fine
    result = CliRunner().invoke(main, ["triton", str(copy), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r/specrt/1/artifact/notes.txt").read_text() == (copy / "manifest.json").read_text()


def test_writer_errors(art, repo, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["triton", str(art), "--out", str(tmp_path / "r"), "--backend", "tensorrt"])
    assert result.exit_code == 1 and f"run `specrt build {art}` first" in result.output
    assert len(result.output.strip().splitlines()) == 1
    result = runner.invoke(main, ["triton", str(art), "--out", str(repo)])
    assert result.exit_code == 1 and "--force" in result.output
    result = runner.invoke(main, ["triton", str(art), "--out", str(tmp_path / "r"), "--method", "mtp"])
    assert result.exit_code == 1 and "needs the artifact's mtp head" in result.output
    result = runner.invoke(main, ["triton", str(art)])
    assert result.exit_code == 1 and "--out" in result.output


def test_cli_writes(art, tmp_path):
    result = CliRunner().invoke(main, ["triton", str(art), "--out", str(tmp_path / "r"), "--instances", "2",
                                       "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [m["name"] for m in report["models"]][0] == "specrt"
    assert "count: 2" in (tmp_path / "r/specrt/config.pbtxt").read_text()
    result = CliRunner().invoke(main, ["triton", str(art), "--out", str(tmp_path / "r"), "--force"])
    assert result.exit_code == 0, result.output
    assert "count: 1" in (tmp_path / "r/specrt/config.pbtxt").read_text()


def test_serve_refuses_what_the_bundled_server_cannot_run(art, tmp_path):
    """--serve runs the stub in this environment: numpy 2 would crash it on the first request, so it refuses before
    writing anything (tests/test_triton_server.py serves from an environment with numpy 1.26); TensorRT repositories
    are for the NGC container."""
    import numpy

    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["triton", str(art), "--out", str(out), "--serve", "--backend", "tensorrt"])
    assert r.exit_code == 1 and "--backend onnxruntime" in r.output and not out.exists()
    if int(numpy.__version__.split(".")[0]) >= 2:
        r = CliRunner().invoke(main, ["triton", str(art), "--out", str(out), "--serve"])
        assert r.exit_code == 1 and "numpy<2" in r.output and "Traceback" not in r.output and not out.exists()


def test_model_py_puts_its_environment_first(tmp_path, monkeypatch):
    """specrt_env.json's existing site folders go ahead of the stub's own sys.path (with their .pth files run);
    missing folders and another Python's environment are skipped."""
    spec = importlib.util.spec_from_file_location("model_env_probe", Path(__file__).parents[1] / "serve/triton/model.py")
    source = spec.loader.get_source("model_env_probe")
    namespace: dict = {"__file__": str(tmp_path / "model.py")}
    exec(compile(source.split("_add_environment(Path(__file__)")[0], "model.py", "exec"), namespace)
    add = namespace["_add_environment"]
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "extra.pth").write_text(str(tmp_path / "via_pth") + "\n")
    (tmp_path / "via_pth").mkdir()
    monkeypatch.setattr(sys, "path", ["/base/lib", "/base/site-packages"])
    env = tmp_path / "specrt_env.json"
    env.write_text(json.dumps({"python": [9, 9], "site": [str(site_dir)]}))
    add(env)
    assert sys.path == ["/base/lib", "/base/site-packages"]  # another Python's folders: untouched
    env.write_text(json.dumps({"python": list(sys.version_info[:2]), "site": [str(site_dir), "/not/here"]}))
    add(env)
    assert sys.path == [str(site_dir), str(tmp_path / "via_pth"), "/base/lib", "/base/site-packages"]


def test_tensorrt_repository(art, tmp_path):
    """With `specrt build`'s engines recorded (stood in for by files here), the debugging models are TensorRT plans
    on a GPU, with the graphs' I/O; the specrt model runs the tensorrt backend."""
    built = Path(shutil.copytree(art, tmp_path / "art"))
    (built / "engines").mkdir()
    manifest = json.loads((built / "manifest.json").read_text())
    manifest["engines"] = {"tensorrt": "10.x", "families": {}}
    for family in manifest["graphs"]:
        (built / f"engines/{family}.plan").write_bytes(b"plan")
        manifest["engines"]["families"][family] = {"engine": f"engines/{family}.plan"}
    (built / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "repo"
    report = write_repository(built, out, backend="tensorrt")
    assert [m["name"] for m in report["models"]] == ["specrt", "specrt_target", "specrt_dspark"]
    assert (out / "specrt_dspark/1/model.plan").read_bytes() == b"plan"
    assert (out / "specrt/1/artifact/engines/target.plan").is_file()
    config = (out / "specrt_target/config.pbtxt").read_text()
    assert 'platform: "tensorrt_plan"' in config and "KIND_GPU" in config
    assert 'string_value: "tensorrt"' in (out / "specrt/config.pbtxt").read_text()
    assert check_repository(out)["problems"] == []
    (out / "specrt_target/config.pbtxt").write_text(config.replace("KIND_GPU", "KIND_CPU"))
    assert check_repository(out)["problems"] == [
        "specrt_target: a TensorRT plan runs on a GPU, not instance_group kind KIND_CPU"]


def test_check_needs_tritonclient(repo, monkeypatch):
    monkeypatch.setitem(sys.modules, "tritonclient.grpc", None)
    result = CliRunner().invoke(main, ["triton", "--check", str(repo)])
    assert result.exit_code == 1
    assert result.output.strip() == ("specrt: error: specrt triton --check needs tritonclient: "
                                     "pip install 'specrt[triton]'")


def test_sampling_parameters_like_vllm():
    """vLLM clients send numbers as strings, top_k -1 for "off", and options at their neutral values."""
    from specrt.serve.triton.sampling import sampling_params

    p = sampling_params(json.dumps({"temperature": "0.7", "top_p": "0.9", "top_k": -1, "max_tokens": "20",
                                    "seed": 3, "stop": "w9", "ignore_eos": "true", "n": 1, "stream": True}),
                        max_tokens=128)
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.seed, p.stop_strings, p.ignore_eos) == (
        0.7, 0.9, 0, 20, 3, ("w9",), True)
    assert sampling_params(None, max_tokens=7).max_new_tokens == 7
    assert sampling_params("{}", max_tokens=7).greedy


# -- the Python model, through the stand-in -------------------------------------------------------------


@pytest.fixture(scope="module")
def pb_utils():
    sys.path.insert(0, str(STUB))
    try:
        import triton_python_backend_utils as stub
    finally:
        sys.path.remove(str(STUB))
    return stub


@pytest.fixture(scope="module")
def model(repo, pb_utils):
    """The repository's own model.py, initialized the way Triton's Python backend does it."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse((repo / "specrt/config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    sys.modules["triton_python_backend_utils"] = pb_utils
    spec = importlib.util.spec_from_file_location("specrt_triton_model", repo / "specrt/1/model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    instance = module.TritonPythonModel()
    instance.initialize({"model_config": json_format.MessageToJson(config, preserving_proto_field_name=True),
                         "model_repository": str(repo / "specrt"), "model_version": "1",
                         "model_instance_kind": "CPU", "model_instance_device_id": "0", "model_name": "specrt"})
    yield instance
    instance.finalize()
    del sys.modules["triton_python_backend_utils"]


@pytest.fixture(scope="module")
def engine(art) -> Engine:
    return Engine(art, threads=1, **METHOD)


def _direct(engine: Engine, ids: list[int], max_new_tokens: int):
    out = engine.generate([Request(ids, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))])[0][0]
    return out.output_ids, out.text


def _request(pb_utils, *, text: str | None = None, ids: list[int] | None = None, stream: bool = False,
             sampling: dict | str | None = None, exclude: bool | None = None):
    inputs = {}
    if text is not None:
        inputs["text_input"] = np.array([text.encode()], dtype=np.object_)
    if ids is not None:
        inputs["input_ids"] = np.array(ids, dtype=np.int32)
    inputs["stream"] = np.array([stream])
    if sampling is not None:
        raw = sampling if isinstance(sampling, str) else json.dumps(sampling)
        inputs["sampling_parameters"] = np.array([raw.encode()], dtype=np.object_)
    if exclude is not None:
        inputs["exclude_input_in_output"] = np.array([exclude])
    return pb_utils.InferenceRequest(inputs)


def _outputs(pb_utils, sent) -> tuple[str, list[int], list[bool]]:
    text, ids, drafted = "", [], []
    for response, _ in sent:
        if response is None:
            continue
        assert not response.has_error(), response.error().message()
        text += pb_utils.get_output_tensor_by_name(response, "text_output").as_numpy()[0].decode()
        ids += pb_utils.get_output_tensor_by_name(response, "token_ids").as_numpy().tolist()
        drafted += pb_utils.get_output_tensor_by_name(response, "drafted").as_numpy().tolist()
    return text, ids, drafted


def _error(sent) -> str:
    assert len(sent) == 1
    response, flags = sent[0]
    assert flags == 1 and response.has_error()
    return response.error().message()


def test_streaming_equals_engine(model, engine, pb_utils, art):
    prompt = "w105 w1 w105 w105"
    request = _request(pb_utils, text=prompt, stream=True, sampling={"max_tokens": "12", "ignore_eos": True})
    model.execute([request])
    sent = request.sender.wait()
    assert sent[-1] == (None, 1) and all(flags == 0 for _, flags in sent[:-1])
    assert len(sent) > 2  # one response per engine step
    text, ids, drafted = _outputs(pb_utils, sent)
    want_ids, want_text = _direct(engine, encode_prompt(engine.tokenizer, prompt), 12)
    assert ids == want_ids and text == want_text
    assert len(drafted) == len(ids) and any(drafted)  # n-gram lookups get accepted in a repetitive output


def test_non_streaming(model, engine, pb_utils):
    ids = [5, 9, 13, 5, 9, 13, 5]
    request = _request(pb_utils, ids=ids, sampling={"max_tokens": 9, "ignore_eos": True})
    model.execute([request])
    sent = request.sender.wait()
    assert len(sent) == 1 and sent[0][1] == 1
    _, got, drafted = _outputs(pb_utils, sent)
    assert got == _direct(engine, ids, 9)[0] and len(drafted) == 9
    # a text prompt comes back first unless exclude_input_in_output (vLLM's convention)
    for exclude, prefix in ((None, "w3 w4"), (True, "")):
        request = _request(pb_utils, text="w3 w4", sampling={"max_tokens": 4, "ignore_eos": True}, exclude=exclude)
        model.execute([request])
        text, got, _ = _outputs(pb_utils, request.sender.wait())
        assert text == prefix + _direct(engine, encode_prompt(engine.tokenizer, "w3 w4"), 4)[1]


def test_bad_requests_get_errors(model, engine, pb_utils):
    bad = [(_request(pb_utils, text="w1", sampling="{not json"), "not valid JSON"),
           (_request(pb_utils, text="w1", sampling={"temperature": -1}), "temperature"),
           (_request(pb_utils, text="w1", sampling={"max_tokens": "many"}), "max_tokens must be an integer"),
           (_request(pb_utils, text="w1", sampling={"max_new_tokens": 2}), "unknown key 'max_new_tokens'"),
           (_request(pb_utils, text="w1", sampling={"best_of": 2}), "does not implement best_of"),
           (_request(pb_utils, ids=list(range(4, 300))), "prompt"),
           (_request(pb_utils, text="w1", ids=[4]), "exactly one of text_input and input_ids"),
           (_request(pb_utils, text="w1", stream=True, exclude=False), "exclude_input_in_output"),
           # hostile: a 5000-digit integer, JSON nested 100,000 deep, a megabyte of text where a number goes
           (_request(pb_utils, text="w1", sampling='{"max_tokens": ' + "9" * 5000 + "}"), "not valid JSON"),
           (_request(pb_utils, text="w1", sampling="[" * 100_000 + "]" * 100_000), "nested too deeply"),
           (_request(pb_utils, text="w1", sampling={"max_tokens": "9" * 1_000_000}), "max_tokens must be an integer"),
           (_request(pb_utils, text="w1", sampling={"x" * 1_000_000: 1}), "unknown key")]
    model.execute([r for r, _ in bad])
    for request, words in bad:
        message = _error(request.sender.wait())
        assert words in message, message
        assert "\n" not in message and len(message) < 400, message[:500]
    good = _request(pb_utils, ids=[7, 8], sampling={"max_tokens": 3, "ignore_eos": True})
    model.execute([good])  # the model keeps serving
    assert _outputs(pb_utils, good.sender.wait())[1] == _direct(engine, [7, 8], 3)[0]


def test_cancel_frees_the_slot(model, pb_utils):
    """A client that goes away after the first streamed response: the request is aborted in the engine (not run to
    its 100 tokens), gets a CANCELLED error as its final response, and its slot is free again."""
    request = _request(pb_utils, ids=[4, 5, 6], stream=True, sampling={"max_tokens": 100, "ignore_eos": True})
    request.sender.cancel_after = 1
    aborted = model.loop.stats.aborted
    model.execute([request])
    sent = request.sender.wait()
    response, flags = sent[-1]
    assert flags == 1 and response.has_error() and "cancel" in response.error().message()
    deadline = time.monotonic() + 10
    while (model.engine.has_unfinished() or model.loop.stats.aborted == aborted) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert model.loop.stats.aborted == aborted + 1
    assert not model.engine.has_unfinished()
    assert len(_outputs(pb_utils, sent[:-1])[1]) < 100


def test_concurrent_requests(model, engine, pb_utils):
    prompts = [[int(t) for t in np.random.default_rng(i).integers(4, 500, 3 + 2 * i)] for i in range(6)]
    requests = [_request(pb_utils, ids=p, stream=i % 2 == 0, sampling={"max_tokens": 8, "ignore_eos": True})
                for i, p in enumerate(prompts)]
    model.execute(requests[:3])
    model.execute(requests[3:])  # 6 requests on 4 slots: two wait for a slot
    for p, r in zip(prompts, requests):
        assert _outputs(pb_utils, r.sender.wait())[1] == _direct(engine, p, 8)[0]


def test_finalize_stops_threads(repo, pb_utils, model):
    engine_threads = [t for t in threading.enumerate() if t.name in ("specrt-engine", "specrt-triton-send")]
    assert len(engine_threads) == 2
    model.finalize()
    assert not any(t.is_alive() for t in engine_threads)
