"""What the commands share: flags declared once, and the console their messages go to.

A group of flags is a dataclass whose fields carry their typer declarations; a command takes the
group as one parameter (`opts: ModelOptions`) and `@with_options` spreads its fields into flags.
"""

import dataclasses
import functools
import inspect
import os
from typing import Annotated, Optional, get_type_hints

import typer
from rich.console import Console

from specsot_mq.devices import REMOTE
from specsot_mq.sampling_params import REPEAT_STOP

err = Console(stderr=True, highlight=False, soft_wrap=True)  # progress and errors; stdout is the answer's

ModelOpt = Annotated[
    Optional[str], typer.Option("--model", "-m", envvar="SPECSOT_MODEL", help="Known model name, a .gguf file or a Hugging Face-format folder.")
]
DtypeOpt = Annotated[str, typer.Option(envvar="SPECSOT_DTYPE",
    help="Activations: auto, bf16 or fp32 (auto: fp32 with quantized weights on a CPU, else bf16 on CUDA and CPUs with native bf16, else whichever is measured faster here).")]
QuantizeOpt = Annotated[str, typer.Option(envvar="SPECSOT_QUANTIZE",
    help="Weights: auto (as the model ships them: the default model's own 4/8-bit GGUF blocks), int4, int8 (quantize a float model at load) or none (dequantized).")]
DeviceOpt = Annotated[Optional[str], typer.Option(help="cpu, cuda or cuda:N (default: cuda if present).")]
RepeatOpt = Annotated[int, typer.Option(
    help="End an output (each phase's) when its last N tokens already ran earlier in it: a loop. 0 = off.")]
TopKOpt = Annotated[int, typer.Option(help="Sample among the k likeliest tokens (0 = all).")]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass.")]
MinPOpt = Annotated[float, typer.Option(help="Drop tokens less likely than this share of the likeliest (0 = off).")]
SeedOpt = Annotated[Optional[int], typer.Option(help="Seed for reproducible sampling.")]
FormatOpt = Annotated[str, typer.Option(help="Prompt format: sot (a numbered plan), plan (the model picks [PLAN] or "
                                              "[DIRECT]), or the path of your own format file (.json, a copy of "
                                              "specsot_mq/prompts/sot.json changed).")]


@dataclasses.dataclass(slots=True)
class ModelOptions:
    """The model, its dtype and its draft head with the shape of its trees (ask, launch, run, chat)."""

    model: ModelOpt = None
    dtype: DtypeOpt = "auto"
    quantize: QuantizeOpt = "auto"
    draft: Annotated[str, typer.Option(envvar="SPECSOT_DRAFT",
        help="EAGLE draft head: auto (the shipped one), none, or a .safetensors path.")] = "auto"
    num_draft_tokens: Annotated[Optional[int], typer.Option(help="Draft tree nodes verified per step.")] = None
    draft_depth: Annotated[Optional[int], typer.Option(help="Deepest level of the draft tree.")] = None
    draft_topk: Annotated[Optional[int], typer.Option(help="Children per expanded node in the draft tree.")] = None
    lookup: Annotated[Optional[int], typer.Option(
        help="Prompt lookup: up to N tokens copied from earlier in the text join each draft tree (greedy only); 0 = off.")] = None
    adaptive: Annotated[Optional[bool], typer.Option("--adaptive/--no-adaptive",
        help="Greedy decoding: each step drafts with the head, uses prompt lookup alone or neither, whichever "
             "has been fastest lately (default); --no-adaptive drafts every step.")] = None

    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs/--no-cuda-graphs", envvar="SPECSOT_CUDA_GRAPHS",
        help="On a GPU, replay captured CUDA graphs for decode and verify steps (default); "
             "--no-cuda-graphs runs every step eagerly, for debugging.")] = True

    def __post_init__(self):
        from specsot_mq.decode_params import check_quantize

        check_quantize(self.quantize)  # before any model is pulled or stage started
        if not self.cuda_graphs:  # read where caches are made (cuda_graphs.wanted), stage processes too
            os.environ["SPECSOT_CUDA_GRAPHS"] = "0"

    def tree(self) -> dict:
        """The TreeParams fields given by flags (a stage process gets them as they are), checked
        now: an impossible tree fails here with one clear error."""
        from specsot_mq.decode_params import TreeParams

        given = {"num_draft_tokens": self.num_draft_tokens, "depth": self.draft_depth, "topk": self.draft_topk,
                 "lookup": self.lookup, "adaptive": self.adaptive}  # fmt: skip
        given = {k: v for k, v in given.items() if v is not None}
        TreeParams(**given)  # validates
        return given


@dataclasses.dataclass(slots=True)
class TopologyOptions:
    """The run a client attaches to, and the topology started when none is live (launch, run, chat)."""

    run: Annotated[str, typer.Option("--run", envvar="SPECSOT_RUN", help="Name of the run (its run file under $SPECSOT_HOME/runs).")] = "default"
    devices: Annotated[str, typer.Option("--devices", envvar="SPECSOT_DEVICES", help="Devices as ip#gpu,... (#cpu for a CPU device).")] = "127.0.0.1#cpu"
    topology: Annotated[str, typer.Option("--topology", envvar="SPECSOT_TOPOLOGY", help="p2p or ring.")] = "p2p"
    split: Annotated[str, typer.Option("--split", envvar="SPECSOT_SPLIT",
        help="none: the whole model on every device; layers: its layers in ranges over the devices, "
             "sized by their memory in devices.json (a model larger than one device).")] = "none"
    replicas: Annotated[int, typer.Option("--replicas", envvar="SPECSOT_REPLICAS",
        help="With --split layers: devices serving each layer range; when one dies the next answers in its place.")] = 1
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", envvar="SPECSOT_PREFILL_CHUNK",
        help="With --split layers: tokens per piece of a long prompt's prefill, pipelined through the ranges (0: one piece).")] = 128


@dataclasses.dataclass(slots=True)
class AnswerOptions:
    """How every answer is made (run; chat, where /set changes it): the SoT way and each phase's
    sampling, checked before any stage starts."""

    sot: Annotated[str, typer.Option(help="auto (the router decides), always or never.")] = "auto"
    max_tokens: Annotated[int, typer.Option(help="Most new tokens per phase.")] = 256
    temperature: Annotated[float, typer.Option(help="0 decodes greedily.")] = 0.0
    top_k: TopKOpt = 0
    top_p: TopPOpt = 1.0
    min_p: MinPOpt = 0.0
    seed: SeedOpt = None
    repeat_stop: RepeatOpt = REPEAT_STOP
    system: Annotated[Optional[str], typer.Option(
        help="A system message before every question (and its conversation); a line of run's own system message wins.")] = None

    def __post_init__(self):
        from specsot_mq.sot.router import check_mode

        check_mode(self.sot)
        self.system = (self.system or "").strip() or None
        self.params()  # SamplingParams checks the rest

    def params(self):
        from specsot_mq.sampling_params import SamplingParams

        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p, seed=self.seed, repeat_stop=self.repeat_stop)  # fmt: skip


@dataclasses.dataclass(slots=True)
class LaunchFlags:
    """What a launch starts beyond the model and devices: stage swaps, remote hosts, SoT limits,
    threads, the prefix store (launch, serve)."""

    stage: Annotated[Optional[list[str]], typer.Option("--stage", help="Swap a stage: KIND=module.path:Class.")] = None
    remote: Annotated[str, typer.Option(help="Command that runs {command} on {host}.")] = REMOTE
    devices_file: Annotated[Optional[str], typer.Option(help="Device profiles (default devices.json).")] = None
    max_points: Annotated[int, typer.Option(help="Most points in a plan.")] = 8
    point_tokens: Annotated[int, typer.Option(help="Most tokens per point.")] = 160
    skeleton_tokens: Annotated[int, typer.Option(help="Most tokens in a skeleton.")] = 128
    base_port: Annotated[int, typer.Option(help="First tcp port (multi-host runs).")] = 5600
    restart: Annotated[bool, typer.Option(help="Restart a stage that dies.")] = True
    prompt_format: FormatOpt = "sot"
    threads: Annotated[Optional[int], typer.Option(
        help="Torch threads of each CPU device stage (default: its share of its host's cores, by how many of them are busy).")] = None
    prefix_cache_mb: Annotated[int, typer.Option(
        help="MB of each device stage's prefix store: a conversation's earlier turns are computed once and reused by its next turn (LRU; 0 = off).")] = 256
    max_len: Annotated[int, typer.Option(help="KV cache length of each device stage (prompt + answer); a longer prompt is refused.")] = 2048
    kv_ship: Annotated[str, typer.Option(
        help="A conversation's next turn on another device than its last: auto asks that device for the earlier turns' KV where "
             "the link's measured bandwidth beats this device's measured prefill; always, never.")] = "auto"

    def options(self) -> dict:
        """As LaunchOptions fields."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["stages"] = fields.pop("stage") or []
        return fields


def with_options(command):
    """Spread each parameter of `command` annotated with an options dataclass into that
    dataclass's flags (in its place), and hand `command` the dataclass built from them."""
    signature = inspect.signature(command, eval_str=True)
    groups = {name: p.annotation for name, p in signature.parameters.items() if dataclasses.is_dataclass(p.annotation)}
    params = []
    for name, p in signature.parameters.items():
        if name not in groups:
            params.append(p)
            continue
        hints = get_type_hints(groups[name], include_extras=True)
        params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
                   for f in dataclasses.fields(groups[name])]  # fmt: skip

    @functools.wraps(command)
    def wrapper(**flags):
        for name, cls in groups.items():
            flags[name] = cls(**{f.name: flags.pop(f.name) for f in dataclasses.fields(cls)})
        return command(**flags)

    wrapper.__signature__ = signature.replace(parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params])
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
