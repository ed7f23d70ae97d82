"""`specrt serve`, `loadtest`, `triton`: serving an artifact (the work is in specrt/serve)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specrt.errors import SpecrtError
from specrt.runtime.config import DEFAULT_SCHEDULER, METHODS, SCHEDULERS
from specrt.cli.options import engine_config, engine_options, say_kernels


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (beyond loopback, set --api-key: anyone who reaches it can generate).")
@click.option("--port", default=8000, show_default=True, help="Port to listen on.")
@click.option("--model-name", default=None, help="The model name clients send [default: the artifact's name].")
@click.option("--slots", type=int, default=None, help="Requests decoded at once [default: the artifact's batch].")
@engine_options
@click.option("--api-key", envvar="SPECRT_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on the API (also from $SPECRT_API_KEY); / and /health stay "
                   "open, the playground asks for the key.")
@click.option("--cors-origin", "cors_origins", multiple=True,
              help="An origin (e.g. https://app.example) whose pages may call the API cross-site; repeatable; "
                   "'*' for any. Default: none (same-origin only).")
@click.option("--allowed-host", "allowed_hosts", multiple=True,
              help="A Host header name to answer besides the bound address's (repeatable; '*' for any). Requests "
                   "naming another host are refused (DNS rebinding).")
@click.option("--max-body-bytes", type=int, default=1 << 20, show_default=True,
              help="Largest request body taken (413 beyond).")
@click.option("--header-timeout", type=float, default=10.0, show_default=True,
              help="Seconds a connection may take to send a request's headers before it is closed.")
@click.option("--body-timeout", type=float, default=30.0, show_default=True,
              help="Seconds a request's body may take to arrive (408 beyond).")
@click.option("--max-connections", type=int, default=256, show_default=True,
              help="Open connections at most; the next one gets a 503 and is closed.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              help="uvicorn's log level.")
def serve(artifact: Path, host: str, port: int, model_name: str | None, slots: int | None, method, gamma, scheduler,
          threshold, ngram, tree, backend, device, dtype, threads, api_key: str | None, cors_origins: tuple[str, ...],
          allowed_hosts: tuple[str, ...], max_body_bytes: int, header_timeout: float, body_timeout: float,
          max_connections: int, log_level: str) -> None:
    """Serve ARTIFACT over the OpenAI HTTP API (/v1/completions, /v1/chat/completions), with a playground at /
    and Prometheus metrics at /metrics."""
    import socket

    import uvicorn

    from specrt import artifact as io
    from specrt.runtime.engine import Engine
    from specrt.serve import guard
    from specrt.serve.app import create_app
    from specrt.serve.loop import EngineLoop

    if max_body_bytes < 1 or max_connections < 1 or not header_timeout > 0 or not body_timeout > 0:
        raise SpecrtError("--max-body-bytes, --max-connections, --header-timeout and --body-timeout must be > 0")
    if api_key is not None and not api_key.strip():
        raise SpecrtError("--api-key is empty")
    manifest = io.load_manifest(artifact)
    if slots is not None and not 1 <= slots <= manifest.export.batch:
        raise SpecrtError(f"--slots must be between 1 and {manifest.export.batch} (the artifact's batch), got {slots}")
    with socket.socket() as probe:  # a busy port is a one-line error, before the engine loads
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise SpecrtError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if not guard.is_loopback(host) and api_key is None:
        click.echo(f"specrt: warning: serving on {host}, beyond the loopback interface, with no --api-key: anyone who "
                   "can reach this port can generate", err=True)
    limits = guard.Limits(max_body_bytes=max_body_bytes, header_timeout_s=header_timeout,
                          body_timeout_s=body_timeout, max_connections=max_connections, api_key=api_key,
                          cors_origins=tuple(cors_origins), allowed_hosts=guard.allowed_hosts(host, allowed_hosts))
    engine = Engine.open(artifact, engine_config(method, gamma, scheduler, threshold, ngram, backend, device, dtype,
                                                  threads, slots=slots or manifest.export.batch, tree=tree))
    name = model_name or manifest.name or artifact.resolve().name
    loop = EngineLoop(engine)
    click.echo(f"specrt: serving {name!r} ({method}, {len(engine.slots)} slots, {backend}) on http://{host}:{port}"
               + (" (API key required)" if api_key else ""), err=True)
    say_kernels(artifact, backend)
    try:
        app = create_app(loop, name, limits)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3,
                    http=guard.guarded_protocol(limits, app.count))
    finally:
        loop.close()



@click.command()
@click.argument("url")
@click.option("--clients", default=32, show_default=True, help="Concurrent streaming clients.")
@click.option("--duration", default=60.0, show_default=True, help="Seconds to keep starting requests.")
@click.option("--prompts", "prompt_files", multiple=True, type=click.Path(path_type=Path),
              help='JSONL of {"turns": [...]} (first turns) [default: the five shipped prompt sets].')
@click.option("--limit", type=int, default=8, show_default=True, help="Prompts taken from each file.")
@click.option("--max-tokens", default=128, show_default=True, help="max_tokens of every request (greedy).")
@click.option("--disconnect-every", default=8, show_default=True,
              help="Every Nth request hangs up after a few chunks (0: never).")
@click.option("--bad-requests/--no-bad-requests", default=True, show_default=True,
              help="One more client sends malformed and invalid requests every 0.5 s; each must get a 4xx.")
@click.option("--verify", "verify_art", type=click.Path(path_type=Path), default=None,
              help="The served artifact: rerun each distinct request on a direct Engine and compare token ids.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def loadtest(url: str, clients: int, duration: float, prompt_files: tuple[Path, ...], limit: int, max_tokens: int,
             disconnect_every: int, bad_requests: bool, verify_art: Path | None, as_json: bool) -> None:
    """Load a running `specrt serve` at URL with concurrent streaming clients; check that nothing is lost."""
    from specrt.runtime.prompts import read_prompts_file
    from specrt.serve.loadtest import run_loadtest

    if clients < 1 or duration <= 0 or max_tokens < 1 or disconnect_every < 0:
        raise SpecrtError("--clients, --duration and --max-tokens must be positive, --disconnect-every >= 0")
    if not prompt_files:
        from importlib import resources

        root = resources.files("specrt.datasets")
        prompt_files = tuple(Path(str(root / f"{n}.jsonl")) for n in ("humaneval", "gsm8k", "math500", "mbpp",
                                                                        "mt-bench"))
    prompts = [p for f in prompt_files for p in read_prompts_file(f, limit)]
    report = run_loadtest(url, prompts, clients=clients, duration_s=duration, max_tokens=max_tokens,
                          disconnect_every=disconnect_every, bad=bad_requests, verify=verify_art,
                          progress=not as_json)
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"{report['requests']} requests ({report['completed']} completed, {report['hung_up']} hung up) "
                   f"from {clients} clients in {report['wall_s']} s: {report['throughput_tok_s']} tok/s, "
                   f"{report['requests_per_s']} req/s ({report['loaded_tok_s']} tok/s while all clients ran"
                   + (f"; a direct engine run: {report['verify']['direct_tok_s']} tok/s" if "verify" in report else "")
                   + ")")
        click.echo(f"time to first token ms {report['ttft_ms']}; latency ms {report['latency_ms']}")
        click.echo(f"active slots after: {report['active_slots_after']}, aborts counted: {report['aborted']:.0f}"
                   + (f"; verified {report['verify']['checked']} streams against {report['verify']['distinct_requests']}"
                      f" direct runs: {report['verify']['mismatches']} mismatches" if "verify" in report else ""))
        bad = report["bad_requests"]
        click.echo(f"bad requests refused with a 4xx: {bad['refused']} of {bad['sent']}")
    if not report["ok"]:
        raise SpecrtError("loadtest failed: " + json.dumps({k: report[k] for k in (
            "errors", "incomplete", "slots_settled", "aborted", "bad_requests")}))



@click.command()
@click.argument("artifact", required=False, type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), default=None, help="The model repository to write.")
@click.option("--check", "check", type=click.Path(path_type=Path), default=None, metavar="REPO",
              help="Validate the model repository REPO (what tritonserver would refuse) instead of writing one.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt"]), default="onnxruntime",
              help="The engine's runtime and the debugging models' platform (onnxruntime_onnx, or tensorrt_plan over "
                   "the engines of `specrt build`, on a GPU).")
@click.option("--instances", default=1, help="Instances of the specrt model (each loads its own engine).")
@click.option("--method", type=click.Choice(METHODS), default="ar", help="Decoding method of the engine.")
@click.option("--gamma", type=int, default=None, help="Drafts verified per round at most [default: the artifact's "
                                                       "verify length - 1].")
@click.option("--scheduler", type=click.Choice(SCHEDULERS), default=DEFAULT_SCHEDULER,
              help="Verify lengths per round (see `specrt run --help`).")
@click.option("--max-tokens", default=128, help="New tokens per request unless its sampling_parameters say otherwise.")
@click.option("--threads", type=int, default=None, help="Intra-op threads per instance (default: all cores).")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@click.option("--serve", "serve_it", is_flag=True,
              help="Then start the Triton Inference Server bundled in the nvidia-pytriton wheel on it, on the CPU, "
                   "until interrupted (needs `pip install 'specrt[cpu,triton-server]'`).")
@click.option("--address", default="127.0.0.1", show_default=True, help="With --serve: the address to listen on.")
@click.option("--http-port", default=8000, show_default=True, help="With --serve: KServe HTTP/REST port.")
@click.option("--grpc-port", default=8001, show_default=True, help="With --serve: KServe gRPC port.")
@click.option("--metrics-port", default=8002, show_default=True, help="With --serve: Prometheus /metrics port.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def triton(artifact: Path | None, out: Path | None, check: Path | None, backend: str, instances: int, method: str,
           gamma: int | None, scheduler: str, max_tokens: int, threads: int | None, force: bool, serve_it: bool,
           address: str, http_port: int, grpc_port: int, metrics_port: int, as_json: bool) -> None:
    """Write a Triton Inference Server model repository for ARTIFACT: a decoupled Python model that streams tokens
    from a specrt engine, and one debugging model per graph. With --serve, start a real Triton server on it. With
    --check REPO, validate a repository instead."""
    if check is not None:
        if artifact is not None or out is not None:
            raise SpecrtError("--check REPO validates a repository; give it without ARTIFACT and --out")
        from specrt.serve.triton.check import check_repository

        report = check_repository(check)
        if as_json:
            click.echo(json.dumps(report))
        else:
            for problem in report["problems"]:
                click.echo(problem)
            if not report["problems"]:
                names = ", ".join(m["name"] for m in report["models"])
                click.echo(f"{check}: {len(report['models'])} models OK ({names})")
        if report["problems"]:
            sys.exit(1)
        return
    if artifact is None or out is None:
        raise SpecrtError("give ARTIFACT and --out REPO to write a repository, or --check REPO to validate one")
    from specrt.serve.triton.repository import write_repository

    if serve_it:
        from specrt.serve.triton import server

        if backend != "onnxruntime":
            raise SpecrtError("--serve runs the bundled CPU server: use --backend onnxruntime (for TensorRT, serve the "
                              "repository from the NGC container)")
        server.check_environment()
        server.bundle()  # before writing anything
    report = write_repository(artifact, out, backend=backend, instances=instances, method=method, gamma=gamma,
                              scheduler=scheduler, max_tokens=max_tokens, threads=threads, force=force)
    say_kernels(artifact, backend)
    if serve_it:
        _serve_triton(out, report, address=address, ports=(http_port, grpc_port, metrics_port), as_json=as_json)
        return
    if as_json:
        click.echo(json.dumps(report))
        return
    graphs = [m["name"] for m in report["models"][1:]]
    click.echo(f"wrote {out}: specrt (Python backend, decoupled, {method}) and {len(graphs)} {backend} debugging "
               f"models ({', '.join(graphs)}); {report['linked']} files hard-linked, {report['copied']} copied")
    click.echo(f"check it with `specrt triton --check {out}`; serve it with `tritonserver --model-repository {out}`")


def _serve_triton(repo: Path, report: dict, *, address: str, ports: tuple[int, int, int], as_json: bool) -> None:
    """Run the bundled tritonserver on the repository just written until interrupted (or until it exits)."""
    import signal
    import tempfile

    from specrt.serve.triton import server

    def interrupted(*_):
        raise KeyboardInterrupt  # SIGTERM stops the server too, like Ctrl-C

    signal.signal(signal.SIGTERM, interrupted)

    http, grpc, metrics = ports
    with tempfile.TemporaryDirectory(prefix="specrt-triton-") as work:
        log = Path(work) / "tritonserver.log"
        proc = server.start(repo, work, http_port=http, grpc_port=grpc, metrics_port=metrics, address=address, log=log)
        info = {"repository": str(repo), "server": server.bundle().version, "pid": proc.pid,
                "http": f"{address}:{http}", "grpc": f"{address}:{grpc}", "metrics": f"{address}:{metrics}"}
        if as_json:
            click.echo(json.dumps({**report, "serving": info}), nl=True)
        else:
            click.echo(f"tritonserver (nvidia-pytriton {info['server']}) serving {repo}, model `specrt` ready: "
                       f"HTTP {info['http']}, gRPC {info['grpc']}, metrics http://{info['metrics']}/metrics; "
                       "Ctrl-C stops it")
        sys.stdout.flush()
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            code = 0
        finally:
            server.stop(proc)
        if code:
            raise SpecrtError(f"tritonserver exited with {code}: {server.log_tail(log)}")
