"""The `tierlm` (alias `run`) command line. Heavy imports happen inside commands, so --help is instant."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from tierlm.config import MODEL_SAMPLING_FIELDS, GenerationDefaults  # light: json and dataclasses only
from tierlm.errors import TierlmError
from tierlm.quant.modes import mode_choices  # light: no torch
from tierlm.runtime.speculative import DEFAULT_DRAFT_TOKENS, DraftSettings  # light: no torch

if TYPE_CHECKING:
    from tierlm.runtime.sampling import SamplingParams  # torch: imported where a command needs it

app = typer.Typer(
    help="Run large language models inside a fixed memory budget.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # Plain help: flags show no `<bool>` placeholder and long texts wrap at word boundaries.
    rich_markup_mode=None,
)

ModelOpt = typer.Option(
    None, "--model", "-m",
    help="Model name (`tierlm list`), HF model directory, .gguf file or artifact directory (default: smollm2)",
)
# `tierlm chat smollm2`, as `ollama run NAME`; the same as --model, which it excludes.
ModelArg = typer.Argument(None, metavar="MODEL", help="Model name or path; the same as --model", show_default=False)
ProfileOpt = typer.Option(
    "24gb", "--profile", "-p",
    help="Shipped profile name or path to a .toml; with --stages, a comma list gives each stage its own",
)
StagesOpt = typer.Option(
    None, "--stages", min=1, show_default=False,
    help="Run the model as a pipeline of N stages, each its own process with a range of layers (N-1 local "
    "workers are started; under torchrun: its WORLD_SIZE ranks)",
)
ContextOpt = typer.Option(
    None, "--context", "-c", metavar="N", show_default=False,
    help="Tokens of context per sequence, prompt and reply together, e.g. 8192 or 32k (default: the profile's "
    "context_length, capped by the model's maximum); the planner charges the KV cache for all of them",
)
KVCacheOpt = typer.Option(
    None, "--kv-cache", metavar="TYPE", show_default=False,
    help="How the KV cache holds keys and values: auto (the compute dtype), f32, f16, bf16, q8_0 (8.5 bits a "
    "value) or q4_0 (4.5 bits) (default: the profile's kv_cache)",
)
DraftOpt = typer.Option(
    None, "--draft", metavar="SOURCE", show_default=False,
    help="Speculative decoding: draft tokens and verify them in one pass over the weights, with output "
    "unchanged. ngram drafts from the conversation's own tokens, strongest where replies quote the prompt; "
    "auto: ngram today; a model's name or path drafts with that smaller model of the same tokenizer, held "
    "beside the model within the profile; off (default: auto; bench: off)",
)
DraftTokensOpt = typer.Option(
    None, "--draft-tokens", metavar="K", show_default=False,
    help=f"Most tokens drafted a pass, 1-64 (default {DEFAULT_DRAFT_TOKENS}); fewer while few are accepted",
)
MAX_NEW_TOKENS = 256
MaxNewOpt = typer.Option(MAX_NEW_TOKENS, "--max-new-tokens", "-n", min=1, help="Most tokens to generate per reply")
# Sampling options default to None: the model's defaults decide (`tierlm show MODEL`), else the fallback.
_FALLBACK = GenerationDefaults()


def _sampling_option(names: tuple[str, ...], text: str, fallback: float, **bounds):
    """A sampling flag whose unset value defers to the model's defaults (runtime/model_defaults.py)."""
    help_text = f"{text} (default: the model's, as `tierlm show MODEL` lists them; else {fallback:g})"
    return typer.Option(None, *names, show_default=False, help=help_text, **bounds)


TempOpt = _sampling_option(("--temperature", "-t"), "Sampling temperature; 0 = greedy", _FALLBACK.temperature, min=0.0)
TopPOpt = _sampling_option(("--top-p",), "Nucleus sampling mass; 1 = off", _FALLBACK.top_p, min=0.0, max=1.0)
TopKOpt = _sampling_option(("--top-k",), "Sample among the k most likely tokens; 0 = off", _FALLBACK.top_k, min=0)
MinPOpt = _sampling_option(
    ("--min-p",), "Keep tokens at least this fraction as likely as the top one; 0 = off", _FALLBACK.min_p,
    min=0.0, max=1.0,
)
# --repeat-penalty is llama.cpp's and Ollama's name; --repetition-penalty (transformers') stays an alias.
RepOpt = _sampling_option(
    ("--repeat-penalty", "--repetition-penalty"), "Penalty for tokens among the last --repeat-last-n; 1 = off",
    _FALLBACK.repetition_penalty, min=0.01,
)
RepLastNOpt = _sampling_option(
    ("--repeat-last-n",), "Tokens the repeat penalty looks back over; 0 = off, -1 = the whole context",
    _FALLBACK.repeat_last_n, min=-1,
)
ThreadsOpt = typer.Option(
    None, "--threads", min=0, show_default=False,
    help="CPU threads for compute (default: the profile's threads, else the CPUs this process may use: "
    "affinity capped by the cgroup CPU quota)",
)
SeedOpt = typer.Option(None, "--seed", help="Random seed, for reproducible sampling")
SystemOpt = typer.Option(None, "--system", "-s", help="System message")
StopOpt = typer.Option(None, "--stop", help="Stop string (repeatable)")
DeviceOpt = typer.Option(None, "--device", help="auto, cpu, cuda, npu or mps (cuda:1, npu:1 pick a card)")
DtypeOpt = typer.Option(None, "--dtype", help="Compute dtype: auto, fp32, fp16, bf16")
QuantOpt = typer.Option(None, "--quant", "-q", help=f"Weight format: {mode_choices()} (default: the profile's)")
LoraOpt = typer.Option(None, "--lora", help="PEFT LoRA adapter directory, optionally :weight (repeatable)")


class _Flags:
    """Options several commands share, gathered into one object (typer needs each command to
    declare them itself, under these fields' names)."""

    @classmethod
    def of(cls, options: dict):
        """From a command's parameters (`locals()` at its top); a field it does not declare keeps its default."""
        return cls(**{f.name: options[f.name] for f in fields(cls) if f.name in options})


@dataclass(frozen=True)
class SamplingFlags(_Flags):
    """--max-new-tokens, --temperature, --top-p, --top-k, --min-p, --repeat-penalty, --repeat-last-n,
    --seed, --stop (chat, generate; serve takes the six with model defaults). None: unset, the
    model's defaults decide."""

    max_new_tokens: int = MAX_NEW_TOKENS
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(self.stop or ()))  # typer: a list, or None when not given
        if self.top_p == 0:  # --top-p 0 has always meant off
            object.__setattr__(self, "top_p", 1.0)

    def params(self, defaults: GenerationDefaults) -> SamplingParams:
        """SamplingParams for one reply: the flags set, the model's `defaults` for the rest."""
        from tierlm.runtime.sampling import resolve_sampling

        return resolve_sampling(defaults, **self._model_fields(), max_new_tokens=self.max_new_tokens, seed=self.seed,
                                stop=self.stop)  # fmt: skip

    def over(self, defaults: GenerationDefaults) -> GenerationDefaults:
        """`defaults` with the flags set in their place (serve: what requests that omit a field get)."""
        return defaults.overridden(self._model_fields(), "a flag of `tierlm serve`")

    def _model_fields(self) -> dict:
        """The flags set among those the model has defaults for."""
        return {name: getattr(self, name) for name in MODEL_SAMPLING_FIELDS if getattr(self, name) is not None}


@dataclass(frozen=True)
class RunFlags(_Flags):
    """--profile, --device, --dtype, --quant, --lora, --threads, --stages, --context, --kv-cache, --draft,
    --draft-tokens: how chat, generate, bench and serve run the model (memory budget, device, compute
    dtype, weight format, adapters, CPU threads, pipeline stages, context per sequence, KV cache format,
    speculative decoding)."""

    profile: str
    device: str | None = None
    dtype: str | None = None
    quant: str | None = None
    lora: tuple[str, ...] = ()
    threads: int | None = None
    stages: int | None = None
    context: str | None = None
    kv_cache: str | None = None
    draft: str | None = None
    draft_tokens: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "lora", tuple(self.lora or ()))  # typer: a list, or None when not given
        self.drafts  # a bad --draft or --draft-tokens is refused before anything loads

    def drafting_by_default(self) -> "RunFlags":
        """These flags with --draft auto where none was given (chat, generate, serve: the policy
        keeps drafts that do not pay from costing; bench measures plain decoding unless asked)."""
        return self if self.draft is not None else replace(self, draft="auto")

    @property
    def drafts(self) -> DraftSettings:
        """--draft and --draft-tokens as the engine takes them."""
        return DraftSettings.parse(self.draft, self.draft_tokens)


def _open(model, run: RunFlags, *, variants: bool = False, batch_size=None, stage_timeout=None,
          engine_drafts: bool = True, parallel: int | None = None):
    """The session `run` asks for: one process, or a pipeline of stages (one per profile).
    `variants` (serve): `--lora NAME=DIR` specs become variants served beside the base, the rest
    are merged into it. `batch_size`: the sequences the planner reserves KV memory for, on every stage.
    `engine_drafts`: give the session's engine --draft (serve's worker takes it from its options
    instead, and a draft model is charged a KV cache per sequence run at once: `parallel`'s, else
    the server's default for the batch size)."""
    from tierlm.cli.progress import progress_factory
    from tierlm.lora.spec import split_variant_specs
    from tierlm.profile import with_run_settings
    from tierlm.runtime.session import open_session

    profiles = [with_run_settings(p, run.context, run.kv_cache) for p in _stage_profiles(run.profile, run.stages)]
    if batch_size is not None:
        profiles = [replace(p, batch_size=batch_size) for p in profiles]
    merged, named = split_variant_specs(run.lora) if variants else (run.lora, {})
    if named and len(profiles) > 1:
        raise TierlmError("LoRA variants are not served over pipeline stages",
                          "merge the adapter into the base with --lora DIR, or drop --stages")  # fmt: skip
    if run.drafts.uses_model and len(profiles) > 1:
        raise TierlmError("a draft model runs in one process, not over pipeline stages",
                          "draft with --draft ngram, or drop --stages")  # fmt: skip
    where = dict(device=run.device, quant=run.quant, threads=run.threads)
    caches = 1 if engine_drafts else _sequences_at_once(profiles[0].batch_size, parallel)
    session = open_session(
        model, profiles[0], dtype=run.dtype, loras=merged, variants=named, progress=progress_factory(), **where,
        **_stage_load(profiles, stage_timeout=stage_timeout, **where), draft=run.drafts, draft_caches=caches,
    )
    if engine_drafts and run.drafts.enabled:  # only then: the engine's first use allocates its KV cache
        session.engine.draft = run.drafts
    return session


def _sequences_at_once(contexts: int, parallel: int | None) -> int:
    from tierlm.server.batch import sequences_at_once

    return sequences_at_once(contexts, parallel)


def _stage_load(profiles: list, **common) -> dict:
    """open_session's `load` for a pipeline of one stage per profile (distributed/pipeline.py);
    nothing for one process."""
    from tierlm.distributed.pipeline import pipeline_load

    return {"load": pipeline_load(profiles, **common)} if len(profiles) > 1 else {}


def _stage_profiles(names: str, stages: int | None) -> list:
    """One Profile per pipeline stage from `--profile a[,b,...]` and `--stages N` (under torchrun
    N is its WORLD_SIZE; a list alone implies one stage each); a single one for one process."""
    from tierlm.distributed.launch import rank_env
    from tierlm.errors import TierlmError
    from tierlm.profile import load_profile

    listed = [load_profile(name.strip()) for name in names.split(",")]
    env = rank_env()
    count = stages or (env.world if env is not None else len(listed))
    if env is not None and count != env.world:
        raise TierlmError(f"--stages {count} under torchrun with WORLD_SIZE={env.world}",
                          f"drop --stages, or launch {count} processes")  # fmt: skip
    if len(listed) not in (1, count):
        raise TierlmError(f"--profile lists {len(listed)} profiles for {count} stages",
                          "give one profile for every stage, or one per stage")  # fmt: skip
    return listed * count if len(listed) == 1 else listed


def _pipeline_worker(device) -> bool:
    """Under torchrun every rank runs the same command: ranks > 0 serve their pipeline stage for
    rank 0 instead (which sends them what to load). True when this process did."""
    from tierlm.distributed.launch import rank_env

    env = rank_env()
    if env is None or env.rank == 0:
        return False
    from tierlm.device.resolve import resolve_device
    from tierlm.distributed.launch import backend_for
    from tierlm.distributed.worker import serve_stage

    serve_stage(env, backend_for(resolve_device(device).type))
    return True


@app.command(short_help="Chat with a model (interactive, or one message per stdin line).")
def chat(
    model_arg: Optional[str] = ModelArg,
    model: Optional[str] = ModelOpt,
    profile: str = ProfileOpt,
    max_new_tokens: int = MaxNewOpt,
    temperature: Optional[float] = TempOpt,
    top_p: Optional[float] = TopPOpt,
    top_k: Optional[int] = TopKOpt,
    min_p: Optional[float] = MinPOpt,
    repetition_penalty: Optional[float] = RepOpt,
    repeat_last_n: Optional[int] = RepLastNOpt,
    seed: Optional[int] = SeedOpt,
    system: Optional[str] = SystemOpt,
    stop: Optional[list[str]] = StopOpt,
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    quant: Optional[str] = QuantOpt,
    lora: Optional[list[str]] = LoraOpt,
    threads: Optional[int] = ThreadsOpt,
    stages: Optional[int] = StagesOpt,
    context: Optional[str] = ContextOpt,
    kv_cache: Optional[str] = KVCacheOpt,
    draft: Optional[str] = DraftOpt,
    draft_tokens: Optional[int] = DraftTokensOpt,
    session_name: Optional[str] = typer.Option(
        None, "--session", metavar="NAME", show_default=False,
        help="Resume the conversation saved as NAME (its KV cache too, when the same model made it) and "
        "save it after each reply",
    ),
):
    """Chat interactively (reads lines from stdin when it is not a terminal). /help lists commands."""
    from tierlm.cli.models import pick_model
    from tierlm.cli.repl import run_chat

    sampling, run = SamplingFlags.of(locals()), RunFlags.of(locals()).drafting_by_default()
    if _pipeline_worker(run.device):
        return
    if session_name is not None:
        from tierlm.runtime.saved_chat import session_path

        session_path(session_name)  # a bad name is refused before the model loads
    with _open(pick_model(model_arg, model), run) as session:
        run_chat(session, sampling.params(session.generation_defaults), system, session_name)


@app.command(short_help="Generate one reply to a prompt; only the text goes to stdout.")
def generate(
    prompt: str = typer.Argument(..., help="Prompt text; '-' reads it from stdin"),
    model: Optional[str] = ModelOpt,
    profile: str = ProfileOpt,
    max_new_tokens: int = MaxNewOpt,
    temperature: Optional[float] = TempOpt,
    top_p: Optional[float] = TopPOpt,
    top_k: Optional[int] = TopKOpt,
    min_p: Optional[float] = MinPOpt,
    repetition_penalty: Optional[float] = RepOpt,
    repeat_last_n: Optional[int] = RepLastNOpt,
    seed: Optional[int] = SeedOpt,
    system: Optional[str] = SystemOpt,
    stop: Optional[list[str]] = StopOpt,
    raw: bool = typer.Option(False, "--raw", help="Skip the chat template; continue the text as given"),
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    quant: Optional[str] = QuantOpt,
    lora: Optional[list[str]] = LoraOpt,
    threads: Optional[int] = ThreadsOpt,
    stages: Optional[int] = StagesOpt,
    context: Optional[str] = ContextOpt,
    kv_cache: Optional[str] = KVCacheOpt,
    draft: Optional[str] = DraftOpt,
    draft_tokens: Optional[int] = DraftTokensOpt,
):
    """Generate one reply. Only the generated text goes to stdout, so it can be piped."""
    sampling, run = SamplingFlags.of(locals()), RunFlags.of(locals()).drafting_by_default()
    if _pipeline_worker(run.device):
        return
    if prompt == "-":
        prompt = sys.stdin.read()
    with _open(model, run) as session:
        params = sampling.params(session.generation_defaults)
        tokenizer = session.engine.tokenizer
        if raw:
            # A raw prompt gets what the tokenizer's post-processor adds (BOS for Llama-style models).
            ids = tokenizer.encode(prompt, add_special_tokens=True)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
        for delta in session.engine.generate(ids, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")


def run_model(name: str, prompt: Optional[list[str]], **options):
    """Chat with MODEL, as `ollama run`; with a PROMPT, print one reply to it and exit ('-' reads it from stdin)."""
    if not prompt:
        return chat(model_arg=name, model=None, **options)
    if options.get("session_name") is not None:
        raise TierlmError("--session resumes a chat; `run MODEL PROMPT` answers one prompt and keeps nothing",
                          "drop the PROMPT to chat in the session, or drop --session")  # fmt: skip
    import inspect

    takes = inspect.signature(generate).parameters
    return generate(" ".join(prompt), model=name, raw=False, **{k: v for k, v in options.items() if k in takes})


def _run_signature():
    """`run`'s parameters: MODEL, PROMPT, then chat's options. Typer reads a command's flags from its
    signature, so `run` takes every flag chat takes, whatever is added there."""
    import inspect

    plain = inspect.Parameter.POSITIONAL_OR_KEYWORD
    head = [
        inspect.Parameter("name", plain, annotation=str, default=typer.Argument(
            ..., metavar="MODEL", show_default=False, help="Model name (`tierlm list`) or path")),
        inspect.Parameter("prompt", plain, annotation=Optional[list[str]], default=typer.Argument(
            None, metavar="PROMPT", show_default=False, help="Prompt (its words joined by spaces); without one, a chat")),
    ]  # fmt: skip
    rest = [p for p in inspect.signature(chat, eval_str=True).parameters.values() if p.name not in ("model_arg", "model")]
    return inspect.Signature(head + rest)


run_model.__signature__ = _run_signature()
app.command("run", short_help="Chat with a model, or answer one prompt (as `ollama run`).")(run_model)


@app.command(short_help="Merge LoRA adapters and quantize into a cached artifact.")
def convert(
    model: Optional[str] = ModelOpt,
    lora: Optional[list[str]] = LoraOpt,
    quant: str = typer.Option(
        "auto", "--quant", "-q", help=f"Weight format: {mode_choices()}; auto: as chat on a CPU would pick"
    ),
):
    """Merge LoRA adapters and quantize into a cached artifact (reused by chat/generate); prints its path."""
    from tierlm.cli.progress import progress_factory
    from tierlm.lora.spec import parse_lora_spec
    from tierlm.offload.sizes import resolve_auto
    from tierlm.quant.modes import concrete_mode
    from tierlm.runtime.source import resolve_model_dir, resolve_source

    progress = progress_factory()
    adapters = tuple(parse_lora_spec(spec) for spec in lora or ())
    model_dir = resolve_model_dir(model, progress)
    mode = concrete_mode(resolve_auto(quant, model_dir), accelerator=False, converted=True)
    resolve_source(model_dir, mode, adapters, accelerator=False)  # a mixed:SIZE below the floor: refused before torch loads
    from tierlm.cache.convert import ConversionRequest, ensure_artifact
    from tierlm.store.calibration import activation_stats

    print(ensure_artifact(ConversionRequest(model_dir, adapters, mode), progress, activation_stats))


cache_app = typer.Typer(help="List, verify or remove cached models and artifacts.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("list", short_help="Cache entries with their kind and size.")
def cache_list():
    """Imported models and compiled artifacts in the cache: kind, size, directory, (name)."""
    from tierlm.cli.models import render_cache_list

    print(render_cache_list())


@cache_app.command("rm", short_help="Remove cache entries (rebuilt on next use).")
def cache_rm(
    names: list[str] = typer.Argument(None, help="Entry names as `cache list` shows them, or model names"),
    all_entries: bool = typer.Option(False, "--all", help="Remove every entry (asks first)"),
    yes: bool = typer.Option(False, "--yes", "-y",
                             help="Do not ask before removing everything, or a base artifact with its variants"),
):
    """Remove cache entries (they are rebuilt on next use)."""
    from tierlm.cli.models import remove_from_cache

    for removed in remove_from_cache(names or [], all_entries, yes):
        print(f"removed {removed.name}", file=sys.stderr)


@cache_app.command("verify", short_help="Check every artifact block against its checksum.")
def cache_verify(names: list[str] = typer.Argument(None, help="Entry names as `cache list` shows them (default: all)")):
    """Read every block of every artifact back and check its checksums; one ok/corrupt line per entry."""
    from tierlm.cache.verify import verify_cache

    verify_cache(names or [], print)


@app.command("list", short_help="The models in the cache by name, with sizes and last use.")
def list_models():
    """The models in the cache by name, with the quant and LoRA variants built from them."""
    from tierlm.cli.models import render_list

    print(render_list())


@app.command(short_help="One model's settings, chat template, artifacts and plan.")
def show(
    name: str = typer.Argument(..., help="Model name (`tierlm list`) or path"),
    profile: str = ProfileOpt,
    device: Optional[str] = DeviceOpt,
):
    """A model's settings, chat template, artifacts, and its plan under a profile."""
    from tierlm.cli.models import render_show

    print(render_show(name, profile, device))


@app.command("import-gguf", short_help="Import a .gguf file into the cache.")
def import_gguf(path: Path = typer.Argument(..., help="A .gguf file: Llama, Qwen2, Mixtral, Qwen2-MoE or Qwen3-MoE")):
    """Import a GGUF file into the cache as a Hugging Face model directory; prints its path."""
    from tierlm.cli.models import import_gguf_command
    from tierlm.cli.progress import progress_factory
    from tierlm.progress import BYTES

    model_dir, name, existed, replaced = import_gguf_command(path, progress_factory()(f"importing {path.name} (one-time)", BYTES))
    print(f"{'already in the cache' if existed else 'imported'} as {name}{replaced}", file=sys.stderr)
    print(model_dir)


@app.command(short_help="Remove a model: its import and every artifact built from it.")
def rm(
    names: list[str] = typer.Argument(..., metavar="MODEL...", help="Model names as `tierlm list` shows them"),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask first (required when stdin is not a terminal)"),
):
    """Remove models from the cache, each with the artifacts built from it; asks first."""
    from tierlm.cli.models import remove_models

    for line in remove_models(names, yes):
        print(line, file=sys.stderr)


@app.command(short_help="The models a running server holds, and where their blocks are.")
def ps(
    host: str = typer.Option("127.0.0.1", "--host", help="The server's address, as given to `serve --host`"),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="The server's port, as given to `serve --port`"),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="TIERLM_API_KEY", help="The key the server was started with, if any"
    ),
):
    """The models a running `tierlm serve` holds: size, where their weight blocks are (device, RAM,
    disk) and until when, as `ollama ps` shows them."""
    from tierlm.cli.running import fetch_running, render_running, server_url

    print(render_running(fetch_running(server_url(host, port), api_key)))


@app.command(short_help="Models are never downloaded: says how to add one.")
def pull(name: Optional[str] = typer.Argument(None, metavar="MODEL", help="What `ollama pull` would fetch")):
    """tierlm never downloads a model; this says how to add one instead."""
    from tierlm.weights.embedded import EMBEDDED_NAME

    raise TierlmError(
        f"tierlm never downloads models{f', so it cannot pull {name}' if name else ''}",
        "import a GGUF file with `tierlm import-gguf FILE`, or give --model a Hugging Face checkpoint "
        f"directory; `tierlm list` shows what is here, {EMBEDDED_NAME} built in",
    )


@app.command(short_help="The shipped memory profiles, or one in full.")
def profiles(name: Optional[str] = typer.Argument(None, help="Show one profile in full (or `auto`)")):
    """List the shipped memory profiles (largest first), or show one."""
    from tierlm.profile import format_size, load_profile, shipped_profiles

    if name:
        profile = load_profile(name)
        for key, value in vars(profile).items():
            shown = format_size(value) if key in ("device_memory", "host_memory", "headroom") else value
            print(f"{key:17} {shown}")
        return
    for shipped in shipped_profiles():
        p = load_profile(shipped)
        print(f"{shipped:6} device {format_size(p.device_memory):>9}  host {format_size(p.host_memory):>9}  {p.description}")
    print(f"{'auto':6} sized from what this machine has free now (`tierlm profiles auto` shows it)")


@app.command(short_help="Where each weight block would live, and the predicted speed.")
def plan(
    model_arg: Optional[str] = ModelArg,
    model: Optional[str] = typer.Option(
        None, "--model", "-m",
        help="Model name (`tierlm list`), HF model directory (config.json alone is enough), artifact directory "
        "or .gguf (default: smollm2)",
    ),
    profile: str = ProfileOpt,
    quant: Optional[str] = QuantOpt,
    device: Optional[str] = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    context: Optional[str] = ContextOpt,
    kv_cache: Optional[str] = KVCacheOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the Placement as JSON"),
    lora: Optional[list[str]] = typer.Option(
        None, "--lora",
        help="NAME=DIR[:WEIGHT]: a LoRA variant served beside the base, placed as `serve --lora` places it "
        "(repeatable); DIR[:WEIGHT] merges the adapter into the base",
    ),
    stages: Optional[int] = typer.Option(
        None, "--stages", min=1, show_default=False,
        help="Split the model over N pipeline stages (one per --profile in a comma list, or N of one profile): "
        "the layers each runs, its plan, and the pipeline's predicted speed",
    ),
    link_gbps: Optional[float] = typer.Option(
        None, "--link-gbps", min=0.001, show_default=False,
        help="With --stages: the link between ranks on other machines, in Gbit/s (default: measured between "
        "two local processes)",
    ),
    link_latency_ms: float = typer.Option(0.05, "--link-latency-ms", min=0.0, help="With --link-gbps: its latency"),
    reprobe_link: bool = typer.Option(False, "--reprobe-link", help="With --stages: measure the local link afresh"),
    draft: Optional[str] = typer.Option(
        None, "--draft", metavar="SOURCE", show_default=False,
        help="Predict speculative decoding too (ngram, auto or a draft model, as chat takes it): the "
        "acceptance measured on this model so far and the decode speed it gives",
    ),
    draft_tokens: Optional[int] = DraftTokensOpt,
):
    """Where every weight block would live under a profile, the memory per tier, and predicted speed.

    Reads no weights: block sizes come from the model's cached artifact for that quant mode when
    there is one, else from config.json. The baseline is charged as the loader charges it, so the
    plan is what loading does; bandwidths come from the probe, corrected by measured runs.
    """
    import json
    from dataclasses import replace

    from tierlm.cli.models import pick_model
    from tierlm.cli.plan_view import plan_with_speculation, render_plan, speculation_lines
    from tierlm.device.cpu import resolve_threads
    from tierlm.errors import TierlmError
    from tierlm.offload.placement import placement_to_dict
    from tierlm.profile import load_profile, with_run_settings
    from tierlm.runtime.source import resolve_model_dir

    settings = dict(context=context, kv_cache=kv_cache)
    drafts = DraftSettings.parse(draft, draft_tokens)
    if stages is not None or "," in profile:
        _plan_stages(pick_model(model_arg, model), profile, stages, quant, device, threads, as_json,
                     link_gbps, link_latency_ms, reprobe_link, settings)  # fmt: skip
        return
    chosen = with_run_settings(load_profile(profile), **settings)
    # The probe and the baseline are keyed on the threads; torch is set to them if the plan loads it.
    chosen = replace(chosen, threads=resolve_threads(threads or chosen.threads))
    model_dir = resolve_model_dir(pick_model(model_arg, model))
    try:
        placement, header, predicted = plan_with_speculation(model_dir, chosen, quant, device, tuple(lora or ()), drafts)
    except TierlmError as refused:  # what one process cannot hold, a pipeline of them may
        from tierlm.runtime.planning import least_stages_for

        more = least_stages_for(model_dir, chosen, quant, device)
        if more is None:
            raise
        hint = f"{refused.hint}; or " if refused.hint else ""
        raise TierlmError(refused.message, f"{hint}split it over {more} processes of this profile: --stages {more}") from None
    if as_json:
        print(json.dumps(placement_to_dict(placement) | ({"speculation": predicted} if predicted else {}), indent=1))
        return
    print("\n".join([render_plan(placement, header),
                     *speculation_lines(predicted, placement.predicted_decode_tokens_per_s)]))  # fmt: skip


def _plan_stages(model, profile, stages, quant, device, threads, as_json, link_gbps, link_latency_ms, reprobe_link,
                 settings):  # fmt: skip
    """`tierlm plan --stages N`: the split over pipeline stages, each stage's plan, the transfers."""
    import json
    from dataclasses import replace

    from tierlm.cli.plan_view import render_stage_plan, stage_plan_for, stage_profiles
    from tierlm.device.cpu import resolve_threads
    from tierlm.probe.link import gbps_link, load_link
    from tierlm.profile import with_run_settings
    from tierlm.runtime.source import resolve_model_dir

    profiles = [with_run_settings(p, **settings) for p in stage_profiles(profile, stages)]
    used = resolve_threads(threads or profiles[0].threads)  # the probe and the baseline are keyed on it
    profiles = [replace(p, threads=used) for p in profiles]
    link = gbps_link(link_gbps, link_latency_ms) if link_gbps is not None else load_link(refresh=reprobe_link)
    planned, header = stage_plan_for(resolve_model_dir(model), profiles, link, quant, device)
    print(json.dumps(planned.to_dict(), indent=1) if as_json else render_stage_plan(planned, header))


@app.command(short_help="Measure prefill, decode and memory against the plan.")
def bench(
    model_arg: Optional[str] = ModelArg,
    model: Optional[str] = ModelOpt,
    profile: str = ProfileOpt,
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    quant: Optional[str] = QuantOpt,
    lora: Optional[list[str]] = LoraOpt,
    threads: Optional[int] = ThreadsOpt,
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", min=1, help="Prompt length (real English text)"),
    tokens: int = typer.Option(64, "--tokens", min=2, help="Tokens to decode per run"),
    runs: int = typer.Option(3, "--runs", min=1, help="Runs; the median is reported"),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON"),
    stages: Optional[int] = StagesOpt,
    context: Optional[str] = ContextOpt,
    kv_cache: Optional[str] = KVCacheOpt,
    draft: Optional[str] = DraftOpt,
    draft_tokens: Optional[int] = DraftTokensOpt,
):
    """Measure prefill and decode speed and memory under a profile, next to the planner's prediction."""
    import json

    from tierlm.cli.bench import format_bench, run_bench
    from tierlm.cli.models import pick_model

    run = RunFlags.of(locals())
    if _pipeline_worker(run.device):
        return
    with _open(pick_model(model_arg, model), run) as session:
        result = run_bench(session, prompt_tokens, tokens, runs)
    print(json.dumps(result, indent=1) if as_json else format_bench(result))


@app.command(short_help="Serve OpenAI- and Ollama-compatible HTTP APIs and a chat page.")
def serve(
    model_arg: Optional[str] = ModelArg,
    model: Optional[str] = ModelOpt,
    profile: str = ProfileOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (default: loopback only)"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port (0 = any free port)"),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="TIERLM_API_KEY",
        help="Require `Authorization: Bearer KEY` on every route but /health and the chat page at /",
    ),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", min=1,
        help="Whole contexts the KV cache holds (default: the profile's batch_size); the planner charges them",
    ),
    parallel: Optional[int] = typer.Option(
        None, "--parallel", min=1, show_default=False,
        help="Most requests decoded at once while their KV pages fit (default: 4 per --batch-size)",
    ),
    max_queue: int = typer.Option(64, "--max-queue", min=0, help="Requests waiting for a slot before 429"),
    timeout: float = typer.Option(600.0, "--timeout", min=0.0, help="Default request deadline in seconds (0 = none)"),
    stall_timeout: float = typer.Option(60.0, "--stall-timeout", min=0.1, help="Restart a worker silent this long (s)"),
    stage_timeout: Optional[float] = typer.Option(
        None, "--stage-timeout", min=0.1, show_default=False,
        help="With --stages: a stage silent this long (no heartbeat) fails the pipeline, which is restarted "
        "(s; default 5, or TIERLM_STAGE_TIMEOUT)",
    ),
    model_name: Optional[str] = typer.Option(
        None, "--model-name", help="Model id to serve under (default: the model's catalogue name)"
    ),
    alias: Optional[list[str]] = typer.Option(
        None, "--alias", help="Another model name requests may use (repeatable); others get 404"
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No access log (one line per request on stderr)"),
    context_shift: bool = typer.Option(
        False, "--context-shift",
        help="A chat request that does not fit the context drops its oldest exchanges (system messages kept), "
        "as chat does, instead of a 400; /v1/completions and /api/generate are still refused",
    ),
    kv_spill_disk: str = typer.Option(
        "2GiB", "--kv-spill-disk", metavar="SIZE",
        help="Disk for idle conversations' KV rows once host RAM's free room is full (a second chat took their "
        "slot); they come back from it when the conversation returns. 0 = none",
    ),
    adapter_dir: Optional[Path] = typer.Option(
        None, "--adapter-dir", metavar="DIR", show_default=False,
        help="POST /v1/adapters loads adapters only from under DIR (symlinks followed); without it, only "
        "adapters the cache knows by name",
    ),
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    quant: Optional[str] = QuantOpt,
    lora: Optional[list[str]] = typer.Option(
        None, "--lora",
        help="NAME=DIR[:WEIGHT]: serve PEFT LoRA adapter DIR as the variant NAME beside the base (requests pick "
        "it by model; the same NAME twice combines adapters); DIR[:WEIGHT] alone merges it into the base "
        "(repeatable)",
    ),
    threads: Optional[int] = ThreadsOpt,
    stages: Optional[int] = StagesOpt,
    context: Optional[str] = ContextOpt,
    kv_cache: Optional[str] = KVCacheOpt,
    draft: Optional[str] = DraftOpt,
    draft_tokens: Optional[int] = DraftTokensOpt,
    temperature: Optional[float] = TempOpt,
    top_p: Optional[float] = TopPOpt,
    top_k: Optional[int] = TopKOpt,
    min_p: Optional[float] = MinPOpt,
    repetition_penalty: Optional[float] = RepOpt,
    repeat_last_n: Optional[int] = RepLastNOpt,
):
    """Serve the model over an OpenAI-compatible API (/v1/chat/completions, /v1/completions), an
    Ollama-compatible one (/api/chat, /api/generate, ...) and a chat page at /."""
    import os

    from tierlm.cli.models import pick_model
    from tierlm.server.options import ServerOptions
    from tierlm.server.run import serve as run_server

    sampling, run = SamplingFlags.of(locals()), RunFlags.of(locals()).drafting_by_default()
    if _pipeline_worker(run.device):
        return
    # Checked before the model loads: a bad flag is told at once.
    options = ServerOptions(
        model_id=model_name,
        aliases=tuple(alias or ()),
        api_key=api_key,
        parallel=parallel,
        max_queue=max_queue,
        default_timeout=timeout or None,
        stall_timeout=stall_timeout,
        access_log=not quiet,
        context_shift=context_shift,
        # Fault injection for the server tests only: an explicit environment switch.
        debug_hooks=os.environ.get("TIERLM_SERVE_DEBUG_HOOKS") == "1",
        adapter_dir=adapter_dir,
        kv_spill_disk=_flag_size(kv_spill_disk, "--kv-spill-disk"),
        draft=run.drafts,
    )
    with _open(pick_model(model_arg, model), run, variants=True, batch_size=batch_size,
               stage_timeout=stage_timeout, engine_drafts=False, parallel=parallel) as session:
        # Sampling flags become the server's defaults for requests that omit the field.
        session.generation_defaults = sampling.over(session.generation_defaults)
        run_server(session, options, host=host, port=port)


def _flag_size(value: str, flag: str) -> int:
    """Bytes from a flag's "2GiB", "500MB" or "0"; one line naming the flag otherwise."""
    from tierlm.units import parse_size

    try:
        return parse_size(value, flag)
    except TierlmError:
        raise TierlmError(f"{flag} {value} is not a size", "give e.g. 2GiB or 500MB, or 0 for none") from None


@app.command(short_help="What this machine offers and why an option is missing.")
def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON"),
    probe: bool = typer.Option(False, "--probe", help="Measure this machine's bandwidths afresh (a minute) and cache them"),
):
    """What this machine offers: torch build, devices and memory, CPU features, the INT8 kernel
    chosen, optional packages, cgroup limit, cache, the bandwidth probe the planner uses; and why
    each missing option is missing."""
    import json

    from tierlm.cli.doctor import collect, render

    report = collect(probe=probe)
    print(json.dumps(report, indent=1) if as_json else render(report))


def _print_version(value: bool) -> None:
    if value:
        from tierlm.cli.models import version_text

        print(version_text())
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_print_version, is_eager=True, help="Print the version and exit"
    ),
):
    """Run large language models inside a fixed memory budget."""


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit status 1."""
    from tierlm.errors import TierlmError

    try:
        app()
    except TierlmError as err:
        print(f"error: {err}", file=sys.stderr)
        _exit(1)
    except KeyboardInterrupt:
        _exit(130)
    except SystemExit as done:
        _exit(done.code)
    _exit(0)


def _exit(code) -> None:
    """Exit with `code`. After a pipeline ran (its session closed already), skip the interpreter's
    teardown: gloo's C++ threads can abort it ("terminate called without an active exception")."""
    if "tierlm.distributed.launch" not in sys.modules:
        sys.exit(code)
    import os

    if isinstance(code, str):
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else int(code is not None))
