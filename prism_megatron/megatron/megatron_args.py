"""A command's Megatron args, as Megatron's own parser makes them, without running the command.

The script decides the parser, as it does when the ranks run: the core driver (``core_gpt.py``)
parses with its own parser; any other script (the training driver, a user's ``pretrain_gpt.py``)
with Megatron-LM's ``megatron.training.arguments`` (``parse_args`` + ``validate_args``, or 0.19's
``parse_and_validate_args``), as rank 0 of ``WORLD_SIZE`` ranks would. Parsing runs in a child
process: the core driver switches on CPU mode when imported, and Megatron-LM's parser keeps global
state and needs the stand-ins of ``megatron_lm``; none of that may touch the caller.

The child serves every command line of one script: planning a run parses its command and then the
micro-batch fold's rewrite of it, and importing Megatron is nearly all of a parse's seconds. Before each
parse it takes the request's environment and resets Megatron's global variables, so each parse is what a
fresh interpreter would give (``tests/test_megatron_args.py``); a change in what decides its imports
(``IMPORT_VARS``) starts another child, and an idle one exits (``IDLE_S``). A run asks for its command's
parse as it starts (``ask_megatron_args``) and imports the fold's Megatron modules while the child works.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import io
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

__all__ = ["ArgsError", "ask_megatron_args", "parse_megatron_args", "close_parser", "padded_vocab", "ESTIMATE_KEY",
           "IDLE_S", "IMPORT_VARS"]

#: key of the parsed args that holds Megatron's theoretical memory of the most loaded shard
#: (``workload.megatron_estimate``, computed in the child where megatron.training is imported)
ESTIMATE_KEY = "prism_megatron_estimate"

#: seconds a parsing child waits for the next command line before it exits (it holds Megatron imported)
IDLE_S = 60.0

_MARK = "PRISM-MEGATRON-ARGS "


class ArgsError(ValueError):
    """Megatron's parser refused the command; the message carries its words."""


#: environment variables that decide what the child imports (which Megatron, which devices): a child is
#: replaced when one changes; every other variable is the request's own, set in the child before it parses
IMPORT_VARS = ("PYTHONPATH", "MEGATRON_LM_PATH", "PRISM_MEGATRON_LM", "CUDA_VISIBLE_DEVICES")


def _child_key(script: Path, env: dict[str, str]) -> tuple:
    return (sys.executable, str(script), *(env.get(name) for name in IMPORT_VARS))


class _Parser:
    """One serving child: a request per line (the command line and the environment to parse it under, as
    JSON), one ``_MARK`` reply line out."""

    def __init__(self, script: Path, env: dict[str, str]) -> None:
        self.key = _child_key(script, env)
        self.script = Path(script)
        self.log = tempfile.TemporaryFile()  # the child's own stderr (imports' warnings), read back on a crash
        self.proc = subprocess.Popen([sys.executable, "-W", "ignore", "-m", __name__, "--serve", str(script)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.pending = b""
        self.parsed: dict[tuple, dict] = {}
        self.asked: list[tuple] = []  # requests sent and not yet answered, in the order the child answers them

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, script_args: list[str], env: dict[str, str]) -> tuple:
        """Send the request for ``script_args`` under ``env`` unless it was sent or answered; its key."""
        key = (tuple(script_args), tuple(sorted(env.items())))
        if key not in self.parsed and key not in self.asked:
            request = {"argv": list(script_args), "env": env}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            self.asked.append(key)
        return key

    def parse(self, script_args: list[str], env: dict[str, str], timeout: float) -> dict:
        """The child's reply for ``script_args`` under ``env``: ``{"args": ...}`` or ``{"error": ...}``; raises
        BrokenPipeError or EOFError where the child was gone before it replied."""
        key = self.ask(script_args, env)
        deadline = time.monotonic() + timeout
        while key not in self.parsed:  # replies come in the order asked: an earlier request's first
            self.parsed[self.asked[0]] = self._reply(deadline, timeout)
            self.asked.pop(0)
        return self.parsed[key]

    def _reply(self, deadline: float, timeout: float) -> dict:
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(_MARK):
                    return json.loads(text[len(_MARK):])
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise ArgsError(f"Megatron's parser did not answer within {timeout:g} s for {self.script.name}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError
                self.pending += chunk

    def stderr_tail(self, lines: int = 6) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().decode(errors="replace").strip().splitlines()[-lines:])

    def close(self) -> None:
        """Kill it: it holds nothing to write, and a graceful exit tears down torch and Megatron for ~1 s."""
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        self.log.close()


_PARSER: _Parser | None = None  # the one live child: another script or IMPORT_VARS value replaces it


def close_parser() -> None:
    """End the parsing child, if any (a run calls it once planned: the child holds Megatron's imports)."""
    global _PARSER
    if _PARSER is not None:
        _PARSER.close()
        _PARSER = None


atexit.register(close_parser)


def _child_env(world_size: int, env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, **(env or {}), "WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0"}


def _serving(script: Path, child_env: dict[str, str]) -> _Parser:
    """The live child for ``script`` under ``child_env``'s IMPORT_VARS, started where there is none."""
    global _PARSER
    if _PARSER is None or _PARSER.key != _child_key(script, child_env) or not _PARSER.alive():
        close_parser()
        _PARSER = _Parser(script, child_env)
    return _PARSER


def ask_megatron_args(script: Path, script_args: list[str], world_size: int, env: dict[str, str] | None = None) -> None:
    """Start parsing ``script script_args`` now and return at once: the child imports Megatron and parses while
    the caller does other work (a run imports the fold's Megatron modules meanwhile); ``parse_megatron_args`` of
    the same command under the same environment then reads its answer. A failure to ask is left to that call."""
    child_env = _child_env(world_size, env)
    with contextlib.suppress(OSError):
        _serving(Path(script), child_env).ask(list(script_args), child_env)


def parse_megatron_args(script: Path, script_args: list[str], world_size: int,
                        env: dict[str, str] | None = None, timeout: float = 300.0) -> argparse.Namespace:
    """Megatron's parsed args for ``script script_args`` at ``world_size`` ranks (values that are not
    JSON, such as dtypes, come back as their ``repr``)."""
    child_env = _child_env(world_size, env)
    for attempt in (1, 2):  # a second child where the first went idle (exit 0) as the request came
        parser = _serving(Path(script), child_env)
        try:
            reply = parser.parse(list(script_args), child_env, timeout)
            break
        except (BrokenPipeError, EOFError):
            try:
                idle = parser.proc.wait(timeout=10) == 0
            except subprocess.TimeoutExpired:
                idle = False
            tail = parser.stderr_tail()
            close_parser()
            if attempt == 2 or not idle:
                raise ArgsError(f"Megatron's parser ended without an answer for {Path(script).name}: {tail}") from None
    if "error" in reply:
        raise ArgsError(f"Megatron's parser refused the command for {Path(script).name}: {reply['error']}")
    return argparse.Namespace(**copy.deepcopy(reply["args"]))  # a caller's changes stay out of the next parse


def _parse_here(script: Path, argv: list[str]) -> argparse.Namespace:
    from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT, DRIVER_SCRIPT

    if script.resolve() == CORE_DRIVER_SCRIPT:
        import importlib.util

        module = sys.modules.get("prism_core_gpt")
        if module is None:  # imported once per child: it switches on CPU mode
            spec = importlib.util.spec_from_file_location("prism_core_gpt", CORE_DRIVER_SCRIPT)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules["prism_core_gpt"] = module
        return module.parse_args(argv)
    from prism_megatron.megatron import cpu_mode
    from prism_megatron.megatron.flags import add_prism_arguments
    from prism_megatron.megatron.megatron_lm import ensure_megatron_training

    if not cpu_mode.cpu_mode_active() and not cpu_mode._gpu_present():
        cpu_mode.enable_cpu_mode()  # validate_args asks torch.cuda for the device's architecture, as ranks do
    ensure_megatron_training()
    from megatron.training import arguments

    defaults = {"tokenizer_type": "NullTokenizer"} if script.resolve() == DRIVER_SCRIPT else {}
    sys.argv = [str(script), *argv]
    if hasattr(arguments, "parse_and_validate_args"):  # 0.19.x
        return arguments.parse_and_validate_args(extra_args_provider=add_prism_arguments, args_defaults=defaults)
    args = arguments.parse_args(extra_args_provider=add_prism_arguments, ignore_unknown_args=False)
    return arguments.validate_args(args, defaults)


def padded_vocab(args: argparse.Namespace) -> int | None:
    """The padded vocabulary Megatron builds: ``padded_vocab_size`` where the parser set it, else a
    NullTokenizer's (one EOD id added) padded to ``make_vocab_size_divisible_by`` x TP as Megatron pads
    it; None where only the tokenizer knows it."""
    import math

    vocab = getattr(args, "padded_vocab_size", None)
    if vocab is None and getattr(args, "tokenizer_type", None) == "NullTokenizer" and getattr(args, "vocab_size", None):
        multiple = (getattr(args, "make_vocab_size_divisible_by", None) or 128) * args.tensor_model_parallel_size
        vocab = math.ceil((args.vocab_size + 1) / multiple) * multiple
    return vocab


def _estimate(args: argparse.Namespace, world: int) -> dict:
    """Megatron's theoretical memory (``workload.megatron_estimate``) for the job's sizes, or why none."""
    from prism_megatron.megatron.megatron_lm import ensure_megatron_training, training_available
    from prism_megatron.megatron.workload import megatron_estimate

    if training_available():
        try:
            ensure_megatron_training()
        except Exception as e:  # the formula only: the plan goes on without it, saying why
            return {"error": f"megatron.training does not import ({type(e).__name__}: {e})"}
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp = world // (tp * pp * (getattr(args, "context_parallel_size", None) or 1))
    vocab = padded_vocab(args)
    if vocab is None:
        return {"error": "the padded vocabulary is known only once the tokenizer is built (not a NullTokenizer)"}
    micro = args.global_batch_size // (args.micro_batch_size * dp) if dp else 0
    if micro < 1:
        return {"error": f"global batch {args.global_batch_size} < micro batch {args.micro_batch_size} x DP{dp}"}
    return megatron_estimate(args, vocab, data_parallel_size=dp, num_microbatches=micro) | {"vocab": vocab}


def _reset_megatron() -> None:
    """Megatron-LM's global variables unset, as in a fresh interpreter (0.19's parser sets them)."""
    gv = sys.modules.get("megatron.training.global_vars")
    if gv is None:
        return
    if hasattr(gv, "unset_global_variables"):  # it unsets the micro-batch calculator too
        gv.unset_global_variables()
    elif hasattr(gv, "destroy_global_vars"):
        gv.destroy_global_vars()


def _answer(script: Path, argv: list[str]) -> dict:
    """One parse, its printing kept from stdout (the replies' channel): ``{"args": ...}`` or ``{"error": ...}``
    (the last lines of what the parser said on stderr, or of the exception)."""
    printed, said = io.StringIO(), io.StringIO()
    _reset_megatron()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
            args = _parse_here(script, argv)
            out = vars(args)
            out[ESTIMATE_KEY] = _estimate(args, int(os.environ["WORLD_SIZE"]))
        return {"args": json.loads(json.dumps(out, default=repr))}
    except AssertionError as e:  # validate_args' checks
        why = f"validate_args: {e}"
    except SystemExit as e:  # argparse: its usage and error are what it printed; the core driver's FlagError says it
        why = "\n".join(filter(None, [said.getvalue() or printed.getvalue(),
                                       e.code if isinstance(e.code, str) else ""]))
    except Exception:  # noqa: BLE001 - any other refusal comes back with its traceback's last lines
        why = traceback.format_exc()
    return {"error": "\n".join(why.strip().splitlines()[-6:])}


def _set_environ(env: dict[str, str]) -> None:
    """This process's environment made the request's, exactly (a fresh child's)."""
    for name in [n for n in os.environ if n not in env]:
        del os.environ[name]
    os.environ.update(env)


def _serve(script: Path) -> int:
    """Answer each command line read from stdin until EOF, or until idle ``IDLE_S``. Read unbuffered by this
    loop: requests asked ahead arrive together, and a buffered reader would hold the second while select
    waits on the pipe for it."""
    replies, fd, pending = sys.stdout, sys.stdin.fileno(), b""
    while True:
        while b"\n" not in pending:
            ready, _, _ = select.select([fd], [], [], IDLE_S)
            chunk = os.read(fd, 1 << 16) if ready else b""
            if not chunk:
                return 0
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        _set_environ(request["env"])
        reply = _answer(script, request["argv"])
        replies.write(_MARK + json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--serve":
        sys.exit(f"usage: python -m {__spec__.name} --serve SCRIPT (command lines as JSON lists on stdin)")
    sys.exit(_serve(Path(sys.argv[2])))
