"""The `bisect` command: argument parsing and output only; the work lives in the core.

Exit codes: 0 aligned, 1 diverged (run: culprits named), 2 usage or input error,
3 backend or load error (and a failed swap self-check), 4 diverged but no culprit set
found within --max-trials, 130 interrupted (SIGINT, SIGTERM or SIGHUP; the trial log is
complete up to the last finished trial). NUMBISECT_DEBUG=1 shows tracebacks.
"""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import sys
import threading
import traceback
import warnings
from pathlib import Path

import click

from numbisect import __version__
from numbisect.backends import BACKENDS, services, user_config_kind
from numbisect.backends.options import parse_opts
from numbisect.common.errors import ExitCode, InputError, NumbisectError, exception_line
from numbisect.common.procenv import no_code_from_cwd, vllm_env_problem
from numbisect.common.jsonsafe import sanitize
from numbisect.common.safeio import (
    JSON_LIMIT,
    check_not_an_input,
    check_output,
    check_output_dir,
    check_trial_log,
    same_file,
)
from numbisect.common.textsafe import clip, path_text, printable
from numbisect.common.threshold import parse_threshold
from numbisect.model import engine_config as E
from numbisect.pipeline.provenance import new_report
from numbisect.report.document import (
    command_line,
    load_report,
    write_json_atomic,
)
from numbisect.report.findings import exit_code as verdict_exit_code
from numbisect.report.plot import plot_format, plot_link
from numbisect.report.plot import require as require_matplotlib
from numbisect.report.plot import write as write_plot
from numbisect.report.summary import render
from numbisect.report.tools import diff, markdown, render_diff
from numbisect.tui.live import LiveConfig, check_live, run_argv

EPILOG = """\b
Exit codes:
  0    aligned (under the threshold)
  1    diverged (run: culprits named)
  2    usage or input error
  3    backend or load error; failed swap self-check
  4    diverged, but no culprit set found within --max-trials (or only --engine-config's settings diverge)
  5    tokens within the threshold, but the engine's checkpoint differs from the reference's (weights or config)
  130  interrupted (Ctrl-C, SIGTERM, SIGHUP)
Set NUMBISECT_DEBUG=1 to see tracebacks."""


class DefaultRun(click.Group):
    """`bisect --swap moe ...` (options, no subcommand) means `bisect run ...`."""

    def parse_args(self, ctx, args):
        if args and args[0].startswith("-") and args[0] not in ("--help", "-h", "--version"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultRun, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="numbisect")
def cli():
    """numbisect: find the module that makes a rollout engine disagree with its reference.

    Bare options run a search: `bisect --swap moe --ref hf:DIR --engine vllm:DIR --trace T`.
    """


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")

    warnings.filterwarnings("ignore")


class Progress:
    """Status lines on stderr: a spinner on a terminal, plain lines otherwise."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self._status = None
        if not quiet and sys.stderr.isatty():
            from rich.console import Console  # lazy: rich loads only when this runs

            self._status = Console(stderr=True).status("starting")

    def __enter__(self):
        if self._status is not None:
            self._status.__enter__()
        return self

    def __exit__(self, *exc):
        if self._status is not None:
            self._status.__exit__(*exc)

    def __call__(self, msg: str) -> None:
        if self.quiet:
            return

        msg = printable(msg)  # a step names paths (the models' directories): one line, no escapes
        if self._status is not None:
            from rich.text import Text  # lazy: rich loads only when this runs

            self._status.update(Text(msg))  # text, not rich markup: a "[" in a path stays a "["
        else:
            print(f"bisect: {msg}", file=sys.stderr, flush=True)


class Floor:
    """`--threshold floor` / `floorxN` as parsed: a factor of the noise floor, resolved
    (from --floor FILE, or by calibrating the reference) in the command body, not while
    the arguments are parsed."""

    def __init__(self, text: str, factor: float):
        self.text, self.factor = text, factor

    def __repr__(self) -> str:
        return self.text


class ThresholdType(click.ParamType):
    """A number at or above 0, or floor / floorxN (a `Floor`). Bad text: one InputError line."""

    name = "threshold"

    def convert(self, value, param, ctx):
        if isinstance(value, (float, Floor)):
            return value
        number, factor = parse_threshold(value)
        return number if factor is None else Floor(str(value).strip(), factor)


class MegabytesType(click.types.FloatParamType):
    """A positive, finite number of MB; anything else one InputError line naming the option."""

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not (v > 0 and math.isfinite(v)):
            raise InputError(f"{param.opts[0]} must be a positive number of MB (got {v:g})")
        return v


class AtLeastOneType(click.types.IntParamType):
    """An integer of 1 or more (--max-trials)."""

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if v < 1:
            raise InputError(f"{param.opts[0]} must be at least 1")
        return v


# Every option that more than one command takes, declared once: name -> click.option's
# arguments. A command picks them with `options(...)`; only `required` differs between
# commands (tui's --ref/--engine/--trace are optional: live mode). Options that share a
# name but not a meaning stay with their command: calibrate's --ref-opt (no batch_size:
# --batch-size is its own), calibrate's and selftest's --out/--json (a floor, results;
# not a report), selftest's --engine/--trace (defaults from the fixture) and --threshold
# (an override of the engine profile's, no floor).
OPTIONS = {
    "ref": (("--ref",), dict(required=True, metavar="hf:DIR", help="Reference model (transformers checkpoint directory).")),
    "engine": (("--engine",), dict(required=True, metavar="SPEC", help="Engine: vllm:DIR, hf:DIR or rollout (the trace's rollout_logprobs).")),
    "trace": (("--trace",), dict(required=True, type=click.Path(), help="Token trace, JSONL (prompt_ids, completion_ids, ...).")),
    "ref_dtype": (("--ref-dtype",), dict(default="bfloat16", show_default=True, help="float32, bfloat16 or float16.")),
    "engine_dtype": (("--engine-dtype",), dict(default="bfloat16", show_default=True)),
    "ref_opt": (("--ref-opt",), dict(multiple=True, metavar="KEY=VALUE", help="hf options: attn_implementation, experts_implementation, batch_size.")),
    "engine_opt": (("--engine-opt",), dict(multiple=True, metavar="KEY=VALUE", help="Backend options (hf as above; vllm: any LLM() argument).")),
    "engine_fault": (("--engine-fault",), dict(multiple=True, metavar="SPEC", help="Plant a fault in the engine, e.g. moe_combine_bf16@layers.2.moe (repeatable).")),
    "threshold": (("--threshold",), dict(default="1e-3", show_default=True, type=ThresholdType(), metavar="X|floor|floorxN",
                                        help="Aligned when the metric is at or under this; floor / floorxN: N times the calibrated noise floor.")),
    "floor": (("--floor", "floor_file"), dict(type=click.Path(), metavar="FILE",
                                              help="Floor from `bisect calibrate --out` for --threshold floor[xN] [default: calibrate now on --ref and --trace].")),
    "engine_mode": (("--engine-mode",), dict(default="prefill", show_default=True, type=click.Choice(["prefill", "decode"]),
                                            help="decode: prefill the prompt, then decode the completion one forced token per step, as a rollout does (vllm and hf engines); compare also reports decode against prefill.")),
    "metric": (("--metric",), dict(default="k3-mean", show_default=True, type=click.Choice(["k3-mean", "k3-p99", "kl-mean"]))),
    "group": (("--group",), dict(default="completion", show_default=True, help="Token group judged: completion, prompt, all or a trace group (e.g. image).")),
    "group_def": (("--group-def",), dict(multiple=True, metavar="NAME=ID[,ID]", help="A token group of the tokens with these ids (repeatable); `image` comes from the config's image_token_id.")),
    "trace_format": (("--trace-format",), dict(type=click.Choice(["numbisect", "verl", "openrlhf", "trl"]), default=None, help="Field names of an RL rollout dump (JSONL or parquet) [default: detected].")),
    "trace_fields": (("--trace-fields",), dict(metavar="ROLE=FIELD,...", help="Field names of a rollout dump: prompt=,completion=,logprobs= (or sequence=,completion_mask=,logprobs=).")),
    "capture": (("--capture",), dict(default="stats", show_default=True, type=click.Choice(["stats", "full", "memory"]), help="Per-unit capture: streaming statistics; full: also every tensor to --capture-dir; memory: every tensor held in RAM.")),
    "capture_dir": (("--capture-dir",), dict(type=click.Path(), help="--capture full: write each unit's tensors here as safetensors.")),
    "max_capture_mb": (("--max-capture-mb",), dict(type=MegabytesType(), default=None, help="--capture full: RAM buffered before a unit is spilled to disk.")),
    "out": (("--out",), dict(type=click.Path(), help="Write the JSON report here (atomically).")),
    "json": (("--json", "as_json"), dict(is_flag=True, help="Print the report as JSON on stdout instead of the summary.")),
    "threads": (("--threads",), dict(type=click.IntRange(min=1), default=None, metavar="N",
                                    help="torch threads in this process (fp32 results depend on it; recorded in the trial log) [default: torch's, or vLLM's binding].")),
    "quiet": (("-q", "--quiet"), dict(is_flag=True, help="No progress on stderr.")),
    "replay_routing": (("--replay-routing",), dict(type=click.Choice(["ref", "engine"]), default=None, help="MoE routing replay what-if (R3): run the engine with the reference's expert ids (ref) or the reference with the engine's (engine); splits k3 into routing flips and numeric drift.")),
    "replay_indexer": (("--replay-indexer",), dict(is_flag=True, help="Sparse attention replay what-if (GLM-5's DSA indexer): run the engine with the reference's key picks at every indexer, then at each indexer that flipped alone; splits k3 into selection flips and numeric drift (prefill, hf: or vllm: engine).")),
    "strategy": (("--strategy",), dict(default="hierarchical", show_default=True, type=click.Choice(["hierarchical", "linear", "ddmin"]))),
    "engine_config": (("--engine-config", "engine_config"), dict(type=click.Path(), metavar="FILE",
                      help="Your vLLM engine's settings, JSON (or .toml): LLM() arguments (enforce_eager, compilation_config, "
                           "enable_prefix_caching, ...) plus batch (1 or \"all\"), logprobs_mode, sampling; --engine-opt overrides it. "
                           "The token-level comparison runs in them (a child process when hooks cannot), captures and the "
                           "search in the hookable configuration (eager, the same other settings).")),
    "max_trials": (("--max-trials",), dict(type=AtLeastOneType(), default=None, help="Stop the search after this many trials (exit 4).")),
}

SESSION = ("ref", "engine", "trace", "ref_dtype", "engine_dtype", "ref_opt", "engine_opt", "engine_fault", "threshold", "floor",
           "engine_mode", "metric", "group", "group_def", "trace_format", "trace_fields", "capture", "capture_dir", "max_capture_mb",
           "out", "json", "threads", "quiet")


def options(*names, required: bool | None = None):
    """Decorator applying the shared options `names`, in that order (`required` overrides)."""
    def apply(f):
        for name in reversed(names):
            decls, kw = OPTIONS[name]
            if required is not None and "required" in kw:
                kw = {**kw, "required": required}
            f = click.option(*decls, **kw)(f)
        return f
    return apply


def _spec_settings(kw):
    """The run's Spec and Settings from the parsed options. A `--threshold floor[xN]` is
    left a `Floor`: `_resolve_floor` turns it into a number (that may run the reference)."""
    from numbisect.pipeline.measure import (  # lazy: keeps torch out of importing numbisect.cli
        Settings,
        parse_opts,
    )
    from numbisect.session.session import (  # lazy: keeps torch out of importing numbisect.cli
        Spec,  # lazy: keeps torch out of importing numbisect.cli
    )

    spec = Spec(
        ref=kw["ref"],
        engine=kw["engine"],
        trace=kw["trace"],
        ref_dtype=kw["ref_dtype"],
        engine_dtype=kw["engine_dtype"],
        ref_opts=parse_opts(kw["ref_opt"], "--ref-opt"),
        engine_opts=parse_opts(kw["engine_opt"], "--engine-opt"),
        faults=list(kw["engine_fault"]),
        group_defs=list(kw.get("group_def") or ()),
        trace_format=kw.get("trace_format"),
        trace_fields=kw.get("trace_fields"),
        engine_mode=kw.get("engine_mode") or "prefill",
        replay_routing=kw.get("replay_routing"),
        capture=kw.get("capture") or "stats",
        capture_dir=kw.get("capture_dir"),
        max_capture_mb=kw.get("max_capture_mb"),
        threads=kw.get("threads"),
    )
    if kw.get("engine_config"):  # the user's engine settings: the session derives the in-process engine's options
        spec.engine_config = _engine_config(kw["engine_config"], kw["engine_opt"], kw["engine"], spec.engine_opts)
        spec.engine_config_path = kw["engine_config"]
        spec.engine_opts = {}
    if spec.threads:
        from numbisect.session.environment import (  # lazy: keeps torch out of importing numbisect.cli
            set_threads,  # lazy: keeps torch out of importing numbisect.cli
        )

        set_threads(spec.threads)  # before a --threshold floor calibration runs the reference
    if spec.capture == "full" and not spec.capture_dir:
        raise InputError("--capture full needs --capture-dir DIR")
    if spec.capture_dir:
        check_output_dir(spec.capture_dir, "--capture-dir")
    if kw.get("floor_file") and not isinstance(kw["threshold"], Floor):
        raise InputError("--floor needs --threshold floor or floorxN")
    settings = Settings(metric=kw["metric"], group=kw["group"])
    if not isinstance(kw["threshold"], Floor):
        settings.threshold = kw["threshold"]
    return spec, settings


def _engine_config(path: str, engine_opt, engine: str, opts: dict) -> dict:
    """--engine-config FILE with the --engine-opt `opts` (parsed from `engine_opt`) on top,
    checked, and checked by the installed vLLM."""
    config = E.merge(E.load_settings(path), opts)
    E.check_settings(config, "--engine-config/--engine-opt")
    _check_with_vllm(config, path, engine_opt, "--engine-config", engine)
    return config


def _check_with_vllm(settings: dict, path: str | None, opts, option: str, engine: str | None) -> None:
    """Engine settings checked by the installed vLLM's own validation, before any model
    loads (the services of the kind that runs --engine-config: numbisect.backends.vllm.validate);
    the message names the file (or --engine-opt)."""
    if not settings:
        return
    user_kind = user_config_kind()

    given = set(parse_opts(opts, "--engine-opt"))
    file = f"{option} {printable(clip(path, 300))}" if path else option

    def where(key: str) -> str:  # the option a key came from: --engine-opt wins over the file
        return "--engine-opt" if key.split(".")[0] in given else file

    kind, _, d = (engine or "").partition(":")
    services(user_kind).check_with_vllm(settings, where, d if kind == user_kind and os.path.isdir(d) else None)


def _refuse_dump(engine: str) -> None:
    """`run` and the TUI's live mode run swap trials, which a dump cannot."""
    if engine.startswith("dump:"):
        raise InputError("--engine dump:DIR works with `bisect compare` only: a dump cannot run swap trials")


def _resolve_floor(kw, spec, settings, progress) -> None:
    """A `--threshold floor[xN]`: the floor from --floor FILE, or calibrated now (loads the reference)."""
    if isinstance(kw["threshold"], Floor):
        from numbisect.commands.calibrate import (  # lazy: keeps torch out of importing numbisect.cli
            resolve_threshold,  # lazy: keeps torch out of importing numbisect.cli
        )

        settings.threshold, settings.threshold_origin = resolve_threshold(
            kw["threshold"].text, kw.get("floor_file"), spec, kw["metric"], kw["group"], progress=progress)


def _emit(report: dict, kw) -> None:
    if kw.get("out"):
        write_json_atomic(kw["out"], report)
    if kw.get("as_json"):
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        try:  # the run is done and its report written: a summary that fails must not lose it
            text = render(report)
        except Exception as e:
            if os.environ.get("NUMBISECT_DEBUG"):
                traceback.print_exc()
            text = ""
            where = f"; the report is in {path_text(kw['out'])}" if kw.get("out") else "; --json or --out gives the report"
            print(printable(f"bisect: the summary could not be rendered ({exception_line(e)}){where}"),
                  file=sys.stderr)
        sys.stdout.write(text)
        if kw.get("out"):
            sys.stdout.write(f"report: {path_text(kw['out'])}\n")
    sys.stdout.flush()


def _check_out(kw) -> None:
    """Before any model loads: every output can be written and is none of the inputs; a
    vLLM engine can run in this process (`procenv.vllm_env_problem`)."""
    if any(str(kw.get(side) or "").startswith("vllm:") for side in ("ref", "engine")) and vllm_env_problem():
        raise InputError(vllm_env_problem())
    inputs = {"--trace": kw.get("trace"), "--floor": kw.get("floor_file"), "--resume": kw.get("resume"),
              "--engine-config": kw.get("engine_config"), "--good-config": kw.get("good_config")}
    log = kw.get("log_path")
    if kw.get("resume"):
        check_trial_log(kw["resume"])
    for opt, path in (("--out", kw.get("out")), ("--log", log)):
        if path:
            _not_in_a_model(path, opt, kw)
    if kw.get("out"):
        check_output(kw["out"], "--out", {**inputs, "--log": log})
    if log:
        check_output(log, "--log", {k: v for k, v in inputs.items() if k != "--resume"})
        if not kw.get("resume") or not (os.path.exists(log) and same_file(log, kw["resume"])):
            _check_new_log(log, kw.get("resume"))


def _not_in_a_model(path: str, opt: str, kw) -> None:
    """An output that is, links followed, an existing file of a model or dump directory (its
    config.json, a weight file, a dump's manifest) would damage what every later run reads:
    refused."""
    dirs = {}
    for side in ("ref", "engine"):
        kind, _, d = (kw.get(side) or "").partition(":")
        if kind in BACKENDS and d:
            dirs[f"--{side}"] = ("dump" if BACKENDS[kind].source == "dump" else "model", d)
    check_not_an_input(path, opt, None, dirs)


def _check_new_log(log: str, resume: str | None) -> None:
    """A --log that already holds trials is never overwritten (--resume continues it)."""
    try:
        st = os.stat(log)
    except FileNotFoundError:
        return
    except OSError:
        return  # check_output said what it could; opening it will say the rest
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"--log {log} is not a regular file (a trial log must be one: it is locked and appended to)")
    if st.st_size > JSON_LIMIT:  # never read whole (a sparse file of terabytes): no log numbisect wrote
        raise InputError(f"--log {log} is larger than {JSON_LIMIT // 2**20} MB and not a trial log; choose another path")
    from numbisect.commands.run import (  # lazy: keeps torch out of importing numbisect.cli
        holds_trials,
        log_in_use,
        not_a_log,
        not_a_log_error,
    )

    try:
        with open(log, "rb") as fh:
            data = fh.read(JSON_LIMIT + 1)
    except OSError:
        return  # check_output said what it could; opening it will say the rest
    if not_a_log(data):
        raise not_a_log_error(log)
    if holds_trials(data):
        raise log_in_use(log, resume)


def _check_replay_indexer(kw, spec) -> None:
    """--replay-indexer refused, before any model loads, where it cannot run."""
    if kw.get("replay_indexer"):
        from numbisect.pipeline.selection import (  # lazy: keeps torch out of importing numbisect.cli
            check_replay,  # lazy: keeps torch out of importing numbisect.cli
        )

        check_replay(spec)


def _argv() -> list[str]:
    """The command line a report records."""
    return command_line(click.get_current_context().obj["argv"])


@cli.command(epilog=EPILOG)
@options(*SESSION, "replay_routing", "replay_indexer", "engine_config")
@click.option("--local/--no-local", default=True, show_default=True, help="Also feed each engine unit the reference's input (local error).")
def compare(**kw):
    """Run the trace through both models: k3, KL, RL cost and per-unit divergence."""
    from numbisect.commands.compare import compare as do_compare  # lazy: keeps torch out of importing numbisect.cli

    _check_out(kw)
    with Progress(kw["quiet"]) as say:
        spec, settings = _spec_settings(kw)
        _check_replay_indexer(kw, spec)
        _resolve_floor(kw, spec, settings, say)
        report = do_compare(spec, settings, local=kw["local"], replay_indexer=kw["replay_indexer"], argv=_argv(), progress=say)
    _emit(report, kw)
    return verdict_exit_code(report["verdict"], report["inputs"].get("checkpoint_diff"))


@cli.command(epilog=EPILOG)
@options("ref", "engine")
@options("trace", required=False)
@options("ref_dtype", "engine_dtype", "out", "json", "quiet")
def weights(**kw):
    """Per unit, whether the engine computes with the reference's weights (0 all ok, 1 not).

    Each engine tensor is read back in the checkpoint's names and compared with the
    reference's; each unit is also fed the reference's inputs on --trace (default: a few
    random sequences). Statuses: ok, corrupted, missing, buffer differs (and, in the
    training loop, numbisect.live's unwritten and stale)."""
    from numbisect.commands.weights import weights as do_weights  # lazy: keeps torch out of importing numbisect.cli
    from numbisect.live import attach  # lazy: keeps torch out of importing numbisect.cli

    _check_out(kw)
    with Progress(kw["quiet"]) as say:
        report, check = do_weights(kw["ref"], kw["engine"], kw.get("trace"), ref_dtype=kw["ref_dtype"],
                                   engine_dtype=kw["engine_dtype"], argv=_argv(), attach=attach, progress=say)
    if kw.get("out"):
        write_json_atomic(kw["out"], report)
    if kw.get("as_json"):
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        sys.stdout.write("\n".join(check.lines()) + "\n")
        if kw.get("out"):
            sys.stdout.write(f"report: {path_text(kw['out'])}\n")
    sys.stdout.flush()
    return ExitCode.ALIGNED if check.ok else ExitCode.DIVERGED


@cli.command(epilog=EPILOG)
@click.argument("bundle", type=click.Path())
@options("out", "json", "quiet")
def replay(bundle, **kw):
    """Reproduce a replay bundle offline: `bisect compare` on its batch (0 aligned, 1 diverged).

    BUNDLE is the directory numbisect.live's trigger wrote when it fired: the reference is
    its reference weights, the engine vLLM on the weights the live engine held (read back),
    in the live engine's settings (engine.json, as --engine-config), with the faults the
    live engine had planted for its life (NUMBISECT_ENGINE_FAULT), if any. The last line says
    whether the replay names the bundle's finding (verdict, first divergent unit)."""
    from numbisect.commands import replay as RP  # lazy: keeps torch out of importing numbisect.cli
    from numbisect.live.bundle import load, replay_inputs, reproduced  # lazy: keeps torch out of importing numbisect.cli

    b = load(bundle)  # a bad bundle: one line, before anything loads
    inp = replay_inputs(b)
    if kw.get("out"):  # the report never replaces a file of the bundle (its manifest, a part)
        check_not_an_input(kw["out"], "--out", None, {"BUNDLE": ("replay bundle", b.path)})
    if inp["engine_faults"]:  # planted in the live engine for its life: in every engine of the replay too, before it compiles
        env, planted = RP.plant_faults(inp["engine"], inp["engine_faults"])
        print(f"replay: the live engine ran with faults planted ({env}), planted again here: {planted}", file=sys.stderr)
    _check_out({"ref": inp["ref"], "engine": inp["engine"], "trace": inp["trace"], "engine_config": inp["engine_config"],
                "out": kw.get("out")})
    with Progress(kw["quiet"]) as say:
        config = _engine_config(inp["engine_config"], (), inp["engine"], {}) if inp["engine_config"] else None
        report = RP.replay(ref=inp["ref"], engine=inp["engine"], trace=inp["trace"], ref_dtype=inp["ref_dtype"],
                           engine_dtype=inp["engine_dtype"], engine_config=config, engine_config_path=inp["engine_config"],
                           threshold=inp["threshold"], argv=_argv(), progress=say)
    line = RP.record(report, b.path, b.finding, lambda r: reproduced(b, r))
    _emit(report, kw)
    print(printable(line), file=sys.stderr if kw.get("as_json") else sys.stdout)
    return ExitCode.ALIGNED if report["verdict"] == "aligned" else ExitCode.DIVERGED


@cli.command(epilog=EPILOG)
@options(*SESSION)
@click.option("--swap", multiple=True, metavar="KIND[,KIND]", help="Swap every unit of these kinds (moe, attn, norm, mlp, router, experts, embed, lm_head, layer) in one trial.")
@options("replay_routing", "replay_indexer", "strategy", "max_trials", "engine_config")
@click.option("--log", "log_path", type=click.Path(), help="Append each trial to this JSONL log as it ends.")
@click.option("--resume", type=click.Path(), help="Continue from a trial log of an interrupted run (no trial repeated).")
@click.option("--whatif/--no-whatif", default=True, show_default=True, help="Rerun each culprit with its arithmetic in fp32 (suggested fix).")
@click.option("--prefix-reuse/--no-prefix-reuse", default=True, show_default=True,
              help="A trial replays the leading layers it shares with the baseline or an earlier trial instead of recomputing them (same results).")
@click.option("--prefix-cache-mb", type=MegabytesType(), default=None, metavar="MB",
              help="RAM for the layer outputs prefix reuse keeps across trials; over it, older recordings are dropped [default: 4096].")
def run(**kw):
    """Swap reference modules into the engine and search for the culprit units."""
    from numbisect.commands.run import run_report  # lazy: keeps torch out of importing numbisect.cli

    _check_out(kw)
    if kw["swap"] and not any(k.strip() for part in kw["swap"] for k in part.split(",")):
        raise InputError("--swap needs at least one unit kind (e.g. --swap moe or --swap attn,norm)")
    _refuse_dump(kw["engine"])
    with Progress(kw["quiet"]) as say:
        spec, settings = _spec_settings(kw)
        _check_replay_indexer(kw, spec)
        _resolve_floor(kw, spec, settings, say)
        report, code = run_report(spec, settings, swap=list(kw["swap"]), strategy=kw["strategy"], max_trials=kw["max_trials"],
                                  log=kw["log_path"], resume=kw["resume"], whatif=kw["whatif"],
                                  replay_indexer=kw["replay_indexer"], prefix_reuse=kw["prefix_reuse"],
                                  prefix_cache_mb=kw["prefix_cache_mb"], argv=_argv(), progress=say)
    _emit(report, kw)
    stopped = report.get("run_error") or (report.get("search") or {}).get("not_run")
    if stopped:  # the report holds what finished; the error line says why the rest did not
        where = f"; the report is in {kw['out']}" if kw.get("out") else ""
        print(printable(f"bisect: error: {report['search']['stop_reason']}{where}"), file=sys.stderr)
    return code


@cli.command(epilog=EPILOG)
@options("ref", "engine", "trace", "ref_dtype", "engine_dtype", "ref_opt", "engine_opt")
@click.option("--engine-config", "engine_config", type=click.Path(), metavar="FILE",
              help="Your vLLM engine's settings, JSON (or .toml): LLM() arguments (enforce_eager, compilation_config, "
                   "enable_prefix_caching, ...) plus batch (1 or \"all\"), logprobs_mode, sampling. --engine-opt overrides it.")
@click.option("--good-config", "good_config", type=click.Path(), metavar="FILE",
              help="The known-good settings [default: eager, every custom op native (custom_ops [\"none\"]), no prefix caching, batch 1, raw log-probs, tp 1].")
@click.option("--threshold", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="A trial is fixed when its completion k3 against the good configuration is at or under this (0: bitwise equal).")
@options("group", "max_trials")
@click.option("--log", "log_path", type=click.Path(), help="Append each trial to this JSONL log as it ends.")
@click.option("--resume", type=click.Path(), help="Continue from a trial log of an interrupted run (no trial repeated).")
@click.option("--localise/--no-localise", default=True, show_default=True,
              help="Under a guilty custom op, name the units whose local output it changes; under a guilty "
                   "compiled path, the units whose code compiled alone (inductor) differs.")
@click.option("-o", "--out", type=click.Path(), help="Write the JSON report here (atomically).")
@options("json", "quiet")
def conditions(**kw):
    """Which of your engine settings make vLLM's log-probs differ from a known-good configuration."""
    from numbisect.commands.conditions import (  # lazy: keeps torch out of importing numbisect.cli
        CondSession,
        CondSpec,
        run_conditions,
    )
    from numbisect.pipeline.measure import (  # lazy: keeps torch out of importing numbisect.cli
        Settings,
        parse_opts,
    )

    _check_out(kw)
    user = E.load_settings(kw["engine_config"]) if kw["engine_config"] else {}
    user = E.merge(user, parse_opts(kw["engine_opt"], "--engine-opt"))
    E.check_settings(user, "--engine-config/--engine-opt")
    good = E.load_settings(kw["good_config"], "--good-config") if kw["good_config"] else dict(E.GOOD)
    _check_with_vllm(user, kw["engine_config"], kw["engine_opt"], "--engine-config", kw["engine"])
    if kw["good_config"]:
        _check_with_vllm(good, kw["good_config"], (), "--good-config", kw["engine"])
    settings = Settings(threshold=kw["threshold"], group=kw["group"])
    spec = CondSpec(ref=kw["ref"], engine=kw["engine"], trace=kw["trace"], ref_dtype=kw["ref_dtype"],
                    engine_dtype=kw["engine_dtype"], ref_opts=parse_opts(kw["ref_opt"], "--ref-opt"),
                    engine_opts={"user": user, "good": good})
    with Progress(kw["quiet"]) as say:
        sess = CondSession(spec, settings, user, good)
        run_child = services(kw["engine"].partition(":")[0]).run_child  # the engine kind's child runner (numbisect.backends.vllm.child)
        body, code = run_conditions(sess, run_child=run_child, max_trials=kw["max_trials"], log=kw["log_path"],
                                    resume=kw["resume"], localise_culprit=kw["localise"], progress=say)
        report = new_report("conditions", command_line(click.get_current_context().obj["argv"]),
                            sess.inputs(body.pop("_ref_describe", {})), settings.to_dict(), body)
    _emit(report, kw)
    return code


@cli.group()
def report():
    """Work with report files: show, validate, diff, md, plot (no models needed)."""


@cli.command(epilog=EPILOG)
@options("ref", "trace", "ref_dtype")
@click.option("--ref-opt", multiple=True, metavar="KEY=VALUE", help="hf options of the reference: attn_implementation, experts_implementation.")
@click.option("--variant", "variants", multiple=True, metavar="NAME[,NAME]",
              help="Variants to measure: batch, attn, experts, dtype [default: batch, attn, experts (MoE models), dtype when --dtype-variant is given].")
@click.option("--dtype-variant", metavar="DTYPE", help="Also measure the reference in this dtype (e.g. float32).")
@click.option("--batch-size", default=4, show_default=True, type=int, help="Batch size of the batch variant (right padding).")
@options("trace_format", "trace_fields")
@click.option("--out", type=click.Path(), help="Write the floor as JSON here (for --floor).")
@click.option("--json", "as_json", is_flag=True, help="Print the floor as JSON on stdout instead of the table.")
@options("quiet")
def calibrate(**kw):
    """Measure the noise floor: the reference against harmless variants of itself.

    Per metric (k3-mean, k3-p99, kl-mean, max abs log-prob difference) and variant;
    the floor is the largest. Use it with `run`/`compare --threshold floor[xN] --floor FILE`.
    """
    from numbisect.commands.calibrate import (  # lazy: keeps torch out of importing numbisect.cli
        calibrate as do_calibrate,  # lazy: keeps torch out of importing numbisect.cli
    )
    from numbisect.commands.calibrate import (  # lazy: keeps torch out of importing numbisect.cli
        render as render_floor,  # lazy: keeps torch out of importing numbisect.cli
    )
    from numbisect.pipeline.measure import (  # lazy: keeps torch out of importing numbisect.cli
        parse_opts,  # lazy: keeps torch out of importing numbisect.cli
    )

    _check_out(kw)
    if kw["batch_size"] < 2:  # before the reference loads
        raise InputError("--batch-size must be at least 2 (the reference runs one sample at a time)")
    with Progress(kw["quiet"]) as say:
        doc = do_calibrate(kw["ref"], kw["trace"], dtype=kw["ref_dtype"], ref_opts=parse_opts(kw["ref_opt"], "--ref-opt"),
                           variants=kw["variants"], dtype_variant=kw["dtype_variant"], batch_size=kw["batch_size"], progress=say,
                           trace_format=kw["trace_format"], trace_fields=kw["trace_fields"])
    if kw["out"]:
        write_json_atomic(kw["out"], doc)
    if kw["as_json"]:
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        sys.stdout.write(render_floor(doc) + (f"floor: {path_text(kw['out'])}\n" if kw["out"] else ""))
    sys.stdout.flush()
    return ExitCode.ALIGNED


@report.command("show")
@click.argument("file", type=click.Path())
def report_show(file):
    """Print the summary of a report, from the file alone."""
    r = load_report(file)
    sys.stdout.write(render(r))
    return ExitCode.ALIGNED if r["verdict"] == "aligned" else ExitCode.DIVERGED


@report.command("validate")
@click.argument("file", type=click.Path())
def report_validate(file):
    """Check a report against the JSON Schema of its version."""
    r = load_report(file)

    click.echo(f"{path_text(file)}: valid numbisect report, schema version {r['schema_version']}")
    return ExitCode.ALIGNED


@report.command("diff")
@click.argument("before", type=click.Path())
@click.argument("after", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the diff as JSON on stdout instead of text.")
def report_diff(before, after, as_json):
    """Did the fix work? Compare report BEFORE with AFTER; exit 0 when AFTER is aligned, 1 otherwise."""
    d = diff(load_report(before), load_report(after), labels=(before, after))
    if as_json:
        sys.stdout.write(json.dumps(sanitize(d), indent=1) + "\n")
    else:
        sys.stdout.write(render_diff(d))
    return ExitCode.ALIGNED if d["aligned"] else ExitCode.DIVERGED


@report.command("md")
@click.argument("file", type=click.Path())
@click.option("--plot", "plot_path", type=click.Path(), metavar="PNG|SVG",
              help="Also draw the report's figure (as `report plot`) into this file and link it from the Markdown (needs matplotlib).")
def report_md(file, plot_path):
    """Print a Markdown summary of a report, to paste into a GitHub issue."""
    r = load_report(file)
    text = markdown(r)
    if plot_path:
        _write_plot(r, file, plot_path, "--plot")
        text = plot_link(text, plot_path)
    sys.stdout.write(text)
    return ExitCode.ALIGNED


def _write_plot(r: dict, file: str, out: str, what: str) -> None:
    """Check `out` before drawing (a suffix it can tell, writable, not the report), then draw."""
    plot_format(out)
    check_output(out, what, {"REPORT": file})
    write_plot(r, out)


@report.command("plot")
@click.argument("file", type=click.Path())
@click.option("--out", type=click.Path(), metavar="PNG|SVG",
              help="Write the figure here (.png or .svg) [default: the report's path with .png].")
def report_plot(file, out):
    """Draw a report's figure: the per-unit error along the depth (propagated and local
    rel-L2, the culprit marked and named) and the search's trials (the judged value per
    trial, the threshold). Needs matplotlib (pip install 'numbisect[plot]'); exit 2 without it.
    """
    require_matplotlib()
    r = load_report(file)
    out = out or str(Path(file).with_suffix(".png"))
    _write_plot(r, file, out, "--out")
    sys.stdout.write(f"plot: {path_text(out)}\n")
    return ExitCode.ALIGNED


@cli.command(epilog=EPILOG)
@click.argument("report_file", required=False, type=click.Path(), metavar="[REPORT.json]")
@options("ref", "engine", "trace", required=False)
@options("ref_dtype", "engine_dtype", "ref_opt", "engine_opt", "engine_fault", "threshold", "floor", "metric", "group", "strategy", "max_trials",
         "engine_mode", "group_def", "trace_format", "trace_fields", "engine_config")
def tui(report_file, **kw):
    """Terminal UI: explore REPORT.json, or run the search live (--ref, --engine, --trace).

    Live mode runs what `bisect run` runs, in the background, while the trials table
    fills in; its exported report is the one `bisect run` writes (with --engine-config,
    the token comparison in your settings and the search in the hookable ones, as `run`
    does). Press ? for keys.
    """
    live_opts = [k for k in ("ref", "engine", "trace") if kw[k]]
    if report_file and live_opts:
        raise InputError("give either REPORT.json or --ref/--engine/--trace (live mode), not both")
    if report_file and kw["engine_config"]:  # a report shows the settings it was run with
        raise InputError("--engine-config is for a live run (--ref, --engine, --trace), not with REPORT.json")
    report, config = None, None
    if report_file:
        report = load_report(report_file)
    elif len(live_opts) < 3:
        raise InputError("bisect tui needs REPORT.json, or --ref, --engine and --trace for a live run")
    else:
        spec, settings = _spec_settings(kw)
        argv = command_line((click.get_current_context().obj or {}).get("argv"))
        config = LiveConfig(spec, settings, strategy=kw["strategy"], max_trials=kw["max_trials"], argv=run_argv(argv))
        check_live(config)
        _refuse_dump(kw["engine"])
        with Progress() as say:  # the cheap checks first: a floor may run the reference
            _resolve_floor(kw, spec, settings, say)
    from numbisect.tui.app import (  # textual is imported only here  # lazy: keeps textual out of importing numbisect.cli
        BisectApp,
        preflight,
    )

    if report is not None:
        preflight(report, report_file)  # a report the TUI cannot draw: one line, exit 2
    app = BisectApp(report=report, report_path=report_file, live=config)
    app.run()
    if app.failure is not None:  # an error inside the app, shown as one line, not a traceback
        what = f"{type(app.failure).__name__}: {printable(clip(app.failure, 200))}"
        if report is not None:
            raise InputError(f"{printable(clip(report_file, 300))}: the TUI cannot show this report ({what})")
        raise RuntimeError(f"the TUI failed ({what})")
    return ExitCode.ALIGNED


@cli.command(epilog=EPILOG)
@options("ref")
@click.option("--engine", metavar="SPEC", help="vllm:DIR or hf:DIR [default: hf on the --ref directory, both in float32].")
@click.option("--trace", type=click.Path(), help="Token trace [default: fixtures/traces/NAME.jsonl when --ref is a fixture].")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the planted units' choice.")
@click.option("--rounds", default=1, show_default=True, type=int, help="Each round plants every fault kind once.")
@click.option("--fault", "faults", multiple=True, metavar="NAME[=VALUE][@UNIT]", help="Plant these faults instead of the engine profile's (repeatable); without @UNIT at a random unit. With --checkpoint-faults: the checkpoint fault kinds to write.")
@click.option("--threshold", type=float, default=None, help="Override the engine profile's threshold.")
@click.option("--local-rank/--no-local-rank", default=True, show_default=True, help="Order the search by local error, as `run` does.")
@click.option("--checkpoint-faults", is_flag=True, help="Instead of runtime faults: damaged copies of the reference checkpoint (norm scaled, gate/up swapped, experts swapped, heads permuted, every layer's norm scaled; config.json's rms_norm_eps, rope_theta, routed_scaling_factor, norm_topk_prob changed), each run with `bisect run`.")
@click.option("--out", type=click.Path(), help="Write the results as JSON here (atomically).")
@options("quiet")
def selftest(**kw):
    """Plant known faults at random units and check that the search names them.

    Exit 0 when every planted fault was found, 1 when one was missed.
    """
    from numbisect.commands import (  # lazy: keeps torch out of importing numbisect.cli
        selftest as ST,  # lazy: keeps torch out of importing numbisect.cli
    )

    _check_out(kw)
    engine, trace, profile = ST.resolve(kw["ref"], kw["engine"], kw["trace"])
    with Progress(kw["quiet"]) as say:
        session = ST.open_session(kw["ref"], engine, trace, profile, kw["threshold"], progress=say)
        try:
            res = ST.selftest(session, profile, rounds=kw["rounds"], seed=kw["seed"], templates=list(kw["faults"]) or None,
                              local_rank=kw["local_rank"], progress=say, checkpoint=kw["checkpoint_faults"])
        finally:
            session.close()
    if kw["out"]:
        write_json_atomic(kw["out"], res)

    sys.stdout.write(ST.render(res) + (f"results: {path_text(kw['out'])}\n" if kw["out"] else ""))
    sys.stdout.flush()
    return ExitCode.ALIGNED if res["passed"] else ExitCode.DIVERGED


class _Signalled(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled as Ctrl-C is: the same cleanup, exit 130."""


def _on_signal(signum, frame):
    raise _Signalled(signal.Signals(signum).name)


def _install_signals() -> dict:
    """SIGTERM and SIGHUP raise in the main thread, like Ctrl-C (previous handlers returned)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, _on_signal)
        except (OSError, ValueError):
            pass
    return old


def main(argv: list[str] | None = None) -> int:
    no_code_from_cwd()  # what this process starts imports nothing from the working directory
    _quiet_libraries()
    debug = bool(os.environ.get("NUMBISECT_DEBUG"))
    previous = _install_signals()
    try:
        args = sys.argv[1:] if argv is None else list(argv)
        bad = next((str(a) for a in args if "\x00" in str(a)), None)  # no command line carries one; a caller's list might
        if bad is not None:
            raise InputError(f"the argument {printable(clip(bad, 80))} holds a NUL character (no path or value can)")
        rv = cli.main(args=args, prog_name="bisect", standalone_mode=False, obj={"argv": ["bisect", *args]})
        return int(rv) if isinstance(rv, int) else 0
    except NumbisectError as e:
        if debug:
            traceback.print_exc()
        hint = f" ({e.hint})" if e.hint else ""
        print(printable(f"bisect: error: {e.message}{hint}"), file=sys.stderr)  # one line, no terminal escapes
        return int(e.code)
    except (click.exceptions.Abort, KeyboardInterrupt) as e:  # click turns Ctrl-C into Abort
        sig = e.__cause__ if isinstance(e, click.exceptions.Abort) else e
        why = f" ({sig.args[0]})" if isinstance(sig, _Signalled) and sig.args else ""
        print(f"bisect: interrupted{why}", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    except click.ClickException as e:
        print(printable(f"bisect: error: {e.format_message()}"), file=sys.stderr)
        return int(ExitCode.USAGE)
    except click.exceptions.Exit as e:
        return int(e.exit_code)
    except Exception as e:  # a bug: still one line unless debugging
        if debug:
            raise
        print(printable(f"bisect: internal error: {type(e).__name__}: {e} (set NUMBISECT_DEBUG=1 for the traceback)"), file=sys.stderr)
        return int(ExitCode.BACKEND)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
