"""``tandem serve``: load a model, then serve it behind the OpenAI API until interrupted.

Before any weight loads it refuses, with one line and exit status 1, a model that is not
there, a port already taken (it binds the socket then, and serves on it) and a cache
directory another process holds (it takes the lock then). A load error of any plugin is one
line naming the file and the field, exit 1 (``tandem_core.cli.load``).

SIGTERM or SIGINT (Ctrl-C) stops it gracefully: the running generations stop and each
engine's session is spilled to its cache directory, to be resumed at the next start.
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any

from tandem_core.cli import CliError, LoadFailed
from tandem_core.settings import SETTINGS

__all__ = ["configure_serve", "run_serve"]


def configure_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a registry id or a checkpoint path (default: the default model)")
    p.add_argument("--weights", help="the checkpoint path, when --model is a registry id")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--parallel", type=int, default=1, help="sequences served at once (one engine each)")
    p.add_argument("--queue", type=int, default=8, help="requests that may wait for an engine (then 429)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 and /metrics")
    p.add_argument("--max-context", type=int, default=8192, help="the most tokens one sequence holds")
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                   help="where the model runs (default auto: the first CUDA device torch sees, else the CPU)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="what it computes in (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--ledger", help="the usage ledger's SQLite file (default: $TANDEM_HOME/ledger.sqlite)")
    p.add_argument("--spec", default="auto", metavar="off|auto|DRAFTER[,DRAFTER]",
                   help="speculative decoding: 'off', or the drafters whose proposals merge into one tree each "
                        "round (lookup, block, lookup,block); default auto: lookup, plus the drafters the model's "
                        "registry entry ships (a block drafter) once pulled. On only when the engine verifies "
                        "trees and passes the load-time self-check")
    p.add_argument("--max-tree", type=int, default=16, metavar="N",
                   help="the most drafted nodes one verify forward carries (default 16)")
    p.add_argument("--no-cache", action="store_true",
                   help="no prefix caches, no disk tier, no session spill: every prefill from cold")
    p.add_argument("--cache-dir", help="this model's disk cache and session spill "
                                       "(default: $TANDEM_HOME/cache/<model id>)")
    p.add_argument("--mem-peak", metavar="BYTES",
                   help="the most memory the process may use at its peak (e.g. 24G, 22.5GiB; default: "
                        "$TANDEM_MEM_PEAK, or measured from the device): the memory gate refuses a prompt "
                        "whose prefill would pass it")


class _Bar:
    """A load progress bar on stderr: redrawn in place on a terminal, a line every quarter otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last: tuple[str, int] | None = None

    def __call__(self, done: int, total: int, what: str) -> None:
        total = max(total, 1)
        frac = min(max(done / total, 0.0), 1.0)
        step = int(frac * 100) if self.tty else int(frac * 4) * 25
        if self.last == (what, step):
            return
        self.last = (what, step)
        width = 30
        fill = round(frac * width)
        line = f"{what:>10} [{'#' * fill}{'.' * (width - fill)}] {frac * 100:5.1f}% {_size(done)}/{_size(total)}"
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done >= total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _logging() -> None:
    level = str(SETTINGS.get("LOG_LEVEL")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("tandem")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def _drafters(spec: str) -> tuple[str, ...]:
    from tandem_core.server.speculation import parse_spec

    return parse_spec(spec)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything loads: a taken port is refused in milliseconds, not after
    the weights (uvicorn serves on this socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
        raise LoadFailed(f"port {port} on {host} {why}; stop the other server or pass --port N") from None
    sock.set_inheritable(True)
    return sock


def run_serve(args: argparse.Namespace) -> int:
    """Refuse what can be refused before the weights load (options, the model's path, the port, the cache
    directory's lock), then load, build the server state and serve until SIGTERM/SIGINT."""
    from tandem_core.cli.load import resolve
    from tandem_core.server.cachedir import CacheDirectoryBusy, lock_directory, parse_bytes

    _logging()
    log = logging.getLogger("tandem.serve")
    if args.parallel < 1 or args.queue < 0:
        raise CliError("--parallel must be >= 1 and --queue >= 0")
    try:
        mem_peak = None if args.mem_peak is None else parse_bytes(args.mem_peak)
    except ValueError as exc:
        raise CliError(f"--mem-peak: {exc}") from exc
    model_id, _ = resolve(args.model, args.weights)
    sock = _bind(args.host, args.port)
    lock = None
    try:
        directory = Path(args.cache_dir).expanduser() if args.cache_dir else None
        if not args.no_cache:
            try:
                lock = lock_directory(model_id, directory)
            except (CacheDirectoryBusy, OSError) as exc:
                raise LoadFailed(str(exc)) from None
        return _serve(args, sock, directory, lock, mem_peak, log)
    finally:
        sock.close()
        if lock is not None and not lock.closed:
            lock.close()    # the server's caches release it at shutdown; this is the path that never got there


def _serve(args: argparse.Namespace, sock: socket.socket, directory: Path | None, lock: IO[str] | None,
           mem_peak: int | None, log: logging.Logger) -> int:
    import uvicorn

    from tandem_core.cli.load import load, placement
    from tandem_core.server.app import ParallelUnavailable, ServerOptions, ServerState, build_app
    from tandem_core.server.caches import CacheOptions
    from tandem_core.server.ledger import default_path
    from tandem_core.server.speculation import SpecOptions
    from tandem_core.server.toolformat import UnknownToolFormat
    from tandem_core.serving import ServeArgs, ServeContext

    ctx = ServeContext(log=lambda line: log.info("%s", line), progress=_Bar())
    t0 = time.perf_counter()
    device, dtype = placement(args.device, args.dtype)
    log.info("device %s, dtype %s", device, dtype)
    served = load(args.model, args.weights, ServeArgs(model_id="", path=Path("."), device=device, dtype=dtype,
                                                      max_context=args.max_context,
                                                      threads=int(SETTINGS.get("THREADS"))), ctx)
    for stage, t in served.info.get("load_stages", ctx.stages):
        print(f"  loaded: {stage:<16} {t:8.2f}s", file=sys.stderr)
    options = ServerOptions(parallel=args.parallel, queue=args.queue, api_key=args.api_key,
                            max_context=args.max_context,
                            ledger=Path(args.ledger).expanduser() if args.ledger else default_path(),
                            wait_comment_s=float(SETTINGS.get("WAIT_COMMENT_S")),
                            side_lane=bool(SETTINGS.get("SIDE_LANE")),
                            caches=None if lock is None else CacheOptions(directory=directory, mem_peak=mem_peak,
                                                                          lock=lock),
                            spec=SpecOptions(drafters=_drafters(args.spec), max_tree=args.max_tree))
    try:
        state = ServerState(served, options)
    except ParallelUnavailable as exc:
        raise CliError(str(exc)) from exc
    except UnknownToolFormat as exc:     # the model's plugin names a format no installed plugin registered
        raise LoadFailed(str(exc)) from exc
    from tandem_core.serving import host_memory

    rss, peak = host_memory()
    log.info("server state built (engines, caches, speculation): host rss %.2f GiB, peak %.2f GiB",
             rss / 2**30, peak / 2**30)
    try:
        app = build_app(served, options, state)
        host = f"[{args.host}]" if ":" in args.host else args.host
        url = f"http://{host}:{args.port}/v1"
        ready = (f"tandem: serving {served.model_id} at {url} (OpenAI-compatible; loaded in "
                 f"{time.perf_counter() - t0:.1f}s, max context {state.max_context}, {args.parallel} engine(s))")

        class _Server(uvicorn.Server):
            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets=sockets)
                if not self.should_exit:
                    print(ready, flush=True)

        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        server = _Server(config)
        server.run(sockets=[sock])
        return 0 if server.started else 1
    finally:
        state.spec.wait()   # a background self-check ends before the interpreter does (torch aborts otherwise)
