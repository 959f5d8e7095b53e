"""Mixture of experts as a layer: a router that sends each token to its top-k experts with
softmax weights (renormalised over the k where the model does), experts that are gated MLPs
(gpt-oss's with biases and a clamped SwiGLU), and the two ways of running them.

- The CPU path (the torch attention backend) sorts the step's (token, expert) pairs by expert
  once and runs each expert once over the tokens routed to it. Float32 gated-SiLU experts
  without biases (Mixtral's, Qwen3-MoE's), and bfloat16 ones, run stacked: their weights
  packed once loaded into the panels of Folio's experts kernel (engine/kernels/cpu/cpu_moe.cpp:
  gate and up in one pass, all experts' products in one parallel loop, float32 products;
  bfloat16 panels where the values allow, multiplied on AMX tiles where the CPU has them, and
  bfloat16 activations by AVX-512 BF16 dot products where it has those), the whole step one C++
  call. Other experts (bfloat16 ones whose sizes are not multiples of 32 on a CPU with Folio's
  bfloat16 tiles, int8/int4, gpt-oss's) run one at a time
  through engine.layers.linear, so their weights get the packed, bfloat16-tile or int8/int4
  forms every other linear gets.
  Either way the sizes depend on the routing, so inside a compiled decode program the experts
  are one opaque op (folio::stacked_experts, or folio::moe_experts, handed the experts' weights
  as tensors and a layout of ints and rebuilding their linears from them): the program around
  it stays one graph.
- The GPU path (the Triton backend) stacks the experts' weights once loaded and runs the fused
  kernel of engine.kernels.triton.fused_moe: the pairs sorted by expert in blocks, one grouped
  GEMM for gate_up, one activation, one grouped GEMM for down, with no host synchronisation.
  gpt-oss's experts add their biases in the GEMMs and apply the clamped SwiGLU between them.

With tensor parallelism each rank holds a slice of every expert (its rows of gate_up, its
columns of down), or with expert parallelism whole experts, an even share of them; either way
its output is partial and one all-reduce per layer sums the ranks'. The router is replicated:
every rank routes the same tokens the same way. This module never reads files and never decides
which model has experts (engine.models does).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.fallback import warn_fallback
from engine.kernels.cpu.capabilities import cpu_capabilities, forced_isa
from engine.layers.activation import ClampedSwiGLU, SiluAndMul
from engine.layers.linear import (
    Bf16Tiles,
    Linear,
    PackedWeight,
    column_linear,
    empty_parameter,
    holds_bf16,
    linear,
    pack_weight,
)
from engine.layers.parallel import (
    SINGLE,
    CheckpointSlice,
    TensorParallel,
    all_reduce_,
    split_evenly,
)
from engine.layers.quantization import GROUPED_INT8, QuantizedWeight

QUANTIZED = ("int8", GROUPED_INT8, "int4")  # QuantizedWeight's methods

logger = logging.getLogger(__name__)


@dataclass
class StackedExperts:
    """A layer's local experts packed for folio_moe::experts (gate_up and down, from
    folio_moe::pack_experts), the only copy of their weights while `gate_up` is set; released
    (None) where the experts' linears are quantized instead."""

    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    # FOLIO_CPU_ISA's choice when packed: AVX-512 code where the CPU has it, unless "avx2".
    allow_avx512: bool

    def release(self) -> None:
        self.gate_up = self.down = None


class ExpertLinear(Linear):
    """An expert's projection: finalized as any linear, unless its layer runs the experts
    stacked (`stacked` set and holding weights), which then holds the only copy: this one's
    weight is freed instead of packed a second time. Quantized, it releases the stack (the
    experts then run one at a time through the quantized linears)."""

    stacked: StackedExperts | None = None

    def kernel_description(self) -> str:
        if self.stacked is not None and self.stacked.gate_up is not None:
            return "experts stacked (Folio)"
        return super().kernel_description()

    def finalize_weights(self, quantization: str | None = None) -> None:
        stacked = self.stacked
        if stacked is not None and stacked.gate_up is not None:
            if not quantization:
                self.weight.data = self.weight.data.new_empty(0)
                return
            stacked.release()
        super().finalize_weights(quantization)


class Router(nn.Module):
    """[T, hidden] -> each token's top-k experts and their weights. Never quantized: a small
    weight whose rounding would change which experts a token reaches."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        bias: bool = False,
        softmax_over_top_k: bool = False,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.softmax_over_top_k = softmax_over_top_k
        self.weight = empty_parameter(num_experts, hidden_size, dtype=dtype, device=device)
        self.bias = empty_parameter(num_experts, dtype=dtype, device=device) if bias else None
        self.packed: PackedWeight | None = None

    def finalize_weights(self) -> None:
        # The same values in the form the CPU multiplies fastest (never quantized): oneDNN's
        # bfloat16 product of a few rows by this small weight took 70 us, its tiles' a few.
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k] int64), as transformers computes them:
        the softmax over every expert in float32, its top k, divided by their sum if asked; or
        (gpt-oss) the top k logits, then their softmax."""
        logits = linear(x, self.weight, self.packed, self.bias).float()
        if self.softmax_over_top_k:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), ids
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, ids


class ExpertDown(ExpertLinear):
    """An expert's down projection over this rank's columns of the intermediate features, with
    no all-reduce of its own (unlike engine.layers.linear's row-parallel layer). Its bias (whole
    on every rank) is added by the first rank only, so that the all-reduce counts it once."""

    def __init__(
        self,
        columns: CheckpointSlice,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel,
        bias: bool = False,
    ) -> None:
        super().__init__(columns.count, [out_features], bias, dtype, device)
        # The loader reads only these columns of the checkpoint's weight.
        self.checkpoint_columns = columns if tp.size > 1 else None
        self.adds_bias = tp.rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed, self.bias if self.adds_bias else None)


class SharedExpertGate(nn.Module):
    """[T, hidden] -> each token's sigmoid weight [T, 1] for the shared expert's output;
    replicated and never quantized, like the router."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_parameter(1, hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


class Expert(nn.Module):
    """One expert's gated MLP, its down projection partial: the MoE layer sums the experts and
    all-reduces once. With `clamped_swiglu` (alpha, limit), gpt-oss's activation instead of
    SiLU; with `bias`, a bias on both projections."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel,
        bias: bool = False,
        clamped_swiglu: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        rows = split_evenly(intermediate_size, tp)
        self.gate_up_proj = cast(
            ExpertLinear,
            column_linear(hidden_size, [rows, rows], bias, dtype, device, tp, ExpertLinear),
        )
        self.act = (
            ClampedSwiGLU(backend, *clamped_swiglu) if clamped_swiglu else SiluAndMul(backend)
        )
        self.down_proj = ExpertDown(rows, hidden_size, dtype, device, tp, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoe(nn.Module):
    """A decoder layer's mixture of experts: `gate` (the router) and `experts`, a dict from the
    checkpoint's expert number to this rank's experts; with `shared_intermediate_size`, also a
    `shared_expert` every token goes through, scaled by `shared_expert_gate` (Qwen2-MoE). With
    `biases`, `softmax_over_top_k` and `clamped_swiglu`, gpt-oss's router and experts
    (engine.models.moe_config says what each means)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
        shared_intermediate_size: int = 0,
        biases: bool = False,
        softmax_over_top_k: bool = False,
        clamped_swiglu: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.tp = tp
        self.gate = Router(
            hidden_size, num_experts, top_k, renormalize, dtype, device, biases, softmax_over_top_k
        )
        # Expert parallelism: an even share of whole experts; otherwise a slice of each.
        local = split_evenly(num_experts, tp) if tp.expert_parallel else None
        self.local_experts = (
            range(local.start, local.start + local.count) if local else range(num_experts)
        )
        expert_tp = SINGLE if tp.expert_parallel else tp
        self.experts = nn.ModuleDict(
            {
                str(e): Expert(
                    hidden_size,
                    intermediate_size,
                    backend,
                    dtype,
                    device,
                    expert_tp,
                    biases,
                    clamped_swiglu,
                )
                for e in self.local_experts
            }
        )
        # Sliced over the ranks like a dense MLP, expert parallelism or not: its partial output
        # joins the routed experts' before their one all-reduce.
        self.shared_expert = (
            Expert(hidden_size, shared_intermediate_size, backend, dtype, device, tp)
            if shared_intermediate_size
            else None
        )
        self.shared_expert_gate = (
            SharedExpertGate(hidden_size, dtype, device) if shared_intermediate_size else None
        )
        # The fused GPU path (set by finalize_weights): every local expert's gate_up and down
        # weights stacked, [E_local, 2I, hidden] and [E_local, hidden, I].
        self.fused = not isinstance(backend, TorchAttentionBackend)
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        # gpt-oss's: the experts' biases stacked ([E_local, 2I] and [E_local, hidden], the
        # latter only on the rank that adds it), and their activation.
        self.b13: torch.Tensor | None = None
        self.b2: torch.Tensor | None = None
        self.fused_act: nn.Module | None = None
        # The CPU path's experts in order, and (gpt-oss) their activation's constants.
        self._expert_list = [cast(Expert, self.experts[str(e)]) for e in self.local_experts]
        self._swiglu = list(clamped_swiglu) if clamped_swiglu else []
        # The CPU path's experts packed for Folio's experts kernel (set by finalize_weights).
        self.stacked: StackedExperts | None = None

    def finalize_weights(self, stack_cpu_experts: bool = True, cpu_pairs: bool = True) -> None:
        """Called before the experts' own linears are finalized: the fused path takes their
        float weights (stacked) and the per-expert modules go; the CPU path packs them for
        Folio's experts kernel where it can (and `stack_cpu_experts`: benchmarks turn it off to
        time the linears one expert at a time; `cpu_pairs` off, no weights packed in pairs: the
        kernel's AVX-512 code over widened panels where it would use AMX, and bfloat16 experts
        one at a time on Folio's tiles where it would use AVX-512 BF16 dot products, the paths
        before each)."""
        if not self.fused:
            if stack_cpu_experts:
                self._stack_cpu_experts(cpu_pairs)
            return
        experts = self._expert_list
        self.w13 = torch.stack([e.gate_up_proj.weight.data for e in experts])
        self.w2 = torch.stack([e.down_proj.weight.data for e in experts])
        first = experts[0]
        if first.gate_up_proj.bias is not None:
            self.b13 = torch.stack([cast(torch.Tensor, e.gate_up_proj.bias).data for e in experts])
        if first.down_proj.bias is not None and first.down_proj.adds_bias:
            self.b2 = torch.stack([cast(torch.Tensor, e.down_proj.bias).data for e in experts])
        self.fused_act = first.act
        self.experts = nn.ModuleDict()
        self._expert_list = []

    def _stack_cpu_experts(self, pairs_allowed: bool) -> None:
        """The experts' weights packed for folio_moe::experts, where they are gated-SiLU MLPs
        without biases on a CPU where Folio's kernels loaded: float32 ones (in bfloat16 panels
        where every value is a bfloat16 one, a bfloat16 checkpoint's: the same products at half
        the bytes), and bfloat16 ones (on AVX2 torch's bfloat16 linears are emulated). bfloat16
        panels go in pairs (`pairs_allowed`, FOLIO_CPU_ISA allowing AVX-512, both sizes
        multiples of 32) where the CPU has AMX, or for bfloat16 experts where it has AVX-512
        BF16's dot products; bfloat16 experts that cannot go in pairs on such a CPU stay on
        Folio's bfloat16 tiles, one at a time."""
        experts = self._expert_list
        if not experts or self._swiglu:
            return
        projections = [p for e in experts for p in (e.gate_up_proj, e.down_proj)]
        dtype = projections[0].weight.dtype
        if any(
            p.bias is not None
            or p.packed is not None
            or p.weight.dtype != dtype
            or p.weight.device.type != "cpu"
            for p in projections
        ):
            return
        caps = cpu_capabilities()
        if not caps.folio_kernels:
            return
        native = forced_isa() == "native"
        down_weight = experts[0].down_proj.weight
        pairs = (
            pairs_allowed
            and native
            and down_weight.shape[0] % 32 == 0  # hidden
            and down_weight.shape[1] % 32 == 0  # this rank's intermediate features
            and (_amx_usable() or (dtype == torch.bfloat16 and caps.avx512_bf16))
        )
        if dtype == torch.float32:
            halves = all(holds_bf16(p.weight) for p in projections)
        elif dtype == torch.bfloat16 and (pairs or not caps.bf16_tiles):
            halves = True
        else:
            return
        pairs = pairs and halves

        def weight(p: Linear) -> torch.Tensor:
            return p.weight.bfloat16() if halves else p.weight

        try:
            gate_up, down = torch.ops.folio_moe.pack_experts(
                [weight(e.gate_up_proj) for e in experts],
                [weight(e.down_proj) for e in experts],
                pairs,
            )
        except Exception as error:  # an optional speed-up: see engine.fallback
            warn_fallback(
                logger, "Folio's stacked CPU experts", "running the experts one at a time", error
            )
            return
        self.stacked = StackedExperts(gate_up, down, native)
        for projection in projections:
            projection.stacked = self.stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        stacked = self.stacked
        if self.fused:
            out = self._fused(x, weights, ids)
        elif stacked is not None and stacked.gate_up is not None and stacked.down is not None:
            kernel = (
                torch.ops.folio.stacked_experts
                if torch.compiler.is_compiling()
                else torch.ops.folio_moe.experts
            )
            out = kernel(
                x,
                weights,
                ids,
                stacked.gate_up,
                stacked.down,
                self.local_experts.start,
                stacked.allow_avx512,
            )
        elif torch.compiler.is_compiling():
            # One opaque op (its sizes depend on the routing): the program stays one graph.
            parts, gate_up, down = self._op_weights()
            out = torch.ops.folio.moe_experts(
                x, weights, ids, parts, gate_up, down, self.local_experts.start, self._swiglu
            )
        else:
            experts = self._expert_list
            out = run_experts(
                x, weights, ids, self.local_experts.start, len(experts), experts.__getitem__
            )
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out += self.shared_expert_gate(x) * self.shared_expert(x)
        return out if self.tp.size == 1 else all_reduce_(out, self.tp)

    def _fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # Imported when used: importing a Triton kernel binds it for the process's life.
        from engine.kernels.triton.fused_moe import fused_moe

        assert self.w13 is not None and self.w2 is not None, "finalize_weights() was not called"
        assert self.fused_act is not None
        first = self.local_experts.start
        if len(self.local_experts) != self.num_experts:  # another rank's experts: no expert here
            local = ids - first
            ids = local.masked_fill_((local < 0) | (local >= len(self.local_experts)), -1)
        return fused_moe(x, self.w13, self.w2, weights, ids, self.b13, self.b2, self.fused_act)

    def _op_weights(self) -> tuple[list[torch.Tensor], list[int], list[int]]:
        """The local experts' weights as folio::moe_experts takes them: every expert's gate_up
        tensors then its down tensors, one expert after another, and the layout of each of the
        two projections (the same for every expert). Traced by dynamo when a program is
        compiled, so plain attribute reads only."""
        parts: list[torch.Tensor] = []
        layouts: list[list[int]] = []
        for expert in self._expert_list:
            down = expert.down_proj
            for projection, bias in (
                (expert.gate_up_proj, expert.gate_up_proj.bias),
                (down, down.bias if down.adds_bias else None),
            ):
                layout, tensors = weight_layout(projection, bias)
                parts.extend(tensors)
                layouts.append(layout)
        if any(layout != layouts[i % 2] for i, layout in enumerate(layouts)):
            raise ValueError("the experts of a layer must share one weight form")
        return parts, layouts[0], layouts[1]


@functools.cache
def _amx_usable() -> bool:
    """Whether Folio's experts kernel may use AMX here (the CPU has it, Linux granted it)."""
    try:
        return bool(torch.ops.folio_moe.amx_usable())
    except Exception as error:  # an optional speed-up: see engine.fallback
        warn_fallback(logger, "AMX for the stacked CPU experts", "using AVX-512", error)
        return False


def run_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int,
    num_local: int,
    expert: Callable[[int], Callable[[torch.Tensor], torch.Tensor]],
    folio_kernels: bool | None = None,
) -> torch.Tensor:
    """The CPU path: each of this rank's `num_local` experts (`expert(e - first_expert)` is
    expert e, asked for only if a token goes to it) once, over the tokens routed to it, added up
    in expert order (as transformers adds them). weights and ids are the router's [T, k]; the
    result is [T, hidden], partial with several ranks. The pairs are sorted, gathered and
    summed back by Folio's kernels (torch.ops.folio_moe: one call each, the same values as
    torch's ops) where they loaded (`folio_kernels`, by default this CPU's), else by torch's."""
    if folio_kernels is None:
        folio_kernels = cpu_capabilities().folio_kernels
    if folio_kernels:
        counts, pairs, rows = torch.ops.folio_moe.route(x, ids, first_expert, num_local)
        local_counts = counts.tolist()
    else:
        local_counts, pairs, rows = _route(x, ids, first_expert, num_local)
    # Each expert reads a contiguous slice of the gathered rows.
    outputs = []
    start = 0
    for local, count in enumerate(local_counts):
        if count:
            outputs.append(expert(local)(rows[start : start + count]))
        start += count
    if not outputs:
        return torch.zeros_like(x)
    if folio_kernels:
        return torch.ops.folio_moe.combine(outputs, pairs, weights, x.shape[0])
    # Weighted as transformers weights (in float32, then rounded to the activations' dtype)
    # and added in one pass: a token's pairs are in expert order.
    h = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    out = torch.zeros_like(x)
    tokens = pairs // ids.shape[1]
    return out.index_add_(0, tokens, (h * weights.flatten()[pairs, None]).to(x.dtype))


def _route(
    x: torch.Tensor, ids: torch.Tensor, first_expert: int, num_local: int
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """folio_moe::route in torch's ops: the local experts' counts, their pairs (flat indices
    into ids) sorted by expert, stably, and x's row of each pair."""
    counts = torch.bincount(ids.flatten(), minlength=first_expert + num_local).tolist()
    # This rank's pairs, sorted by expert: a contiguous run of the sorted pairs.
    begin = sum(counts[:first_expert])
    local_counts = counts[first_expert : first_expert + num_local]
    pairs = ids.flatten().argsort(stable=True)[begin : begin + sum(local_counts)]
    return local_counts, pairs, x[pairs // ids.shape[1]]


# How a linear's weight travels through folio::moe_experts: its tensors, and a layout of ints
# (dynamo folds them into the program as constants): LAYOUT's fields, the form an index into
# FORMS (engine.layers.linear.pack_weight's forms, and QuantizedWeight's methods).
FORMS = ("dense", "oneDNN packed", "bfloat16 tiles", "widened bfloat16 tiles", *QUANTIZED)
LAYOUT = ("form", "out_features", "folio_kernels", "minimum", "torch_int4", "dense_bf16", "bias")


def weight_layout(
    linear: Linear, bias: torch.Tensor | None
) -> tuple[list[int], list[torch.Tensor]]:
    """A linear's weight in the form it runs in, with `bias` (the linear's own, or None), as
    (layout, tensors) for linear_from_layout."""
    packed = linear.packed
    fields = dict.fromkeys(LAYOUT, 0)
    if isinstance(packed, QuantizedWeight) and type(packed) is not QuantizedWeight:
        # A GGUF's fused parts (engine.layers.quantization.PartsWeight): no expert has those.
        raise ValueError(f"experts' weights cannot be {type(packed).__name__} on the CPU")
    if isinstance(packed, QuantizedWeight):
        fields.update(
            form=FORMS.index(packed.method),
            folio_kernels=packed.kernels is not None,
            minimum=packed.minimum is not None,
            torch_int4=packed.torch_int4 is not None,
            dense_bf16=packed.dense_bf16,
        )
        tensors = [packed.codes, packed.scale]
        if packed.minimum is not None:
            tensors.append(packed.minimum)
        if packed.torch_int4 is not None:
            tensors.extend(packed.torch_int4)
    elif isinstance(packed, Bf16Tiles):
        form = "widened bfloat16 tiles" if packed.widened else "bfloat16 tiles"
        fields.update(form=FORMS.index(form), out_features=packed.out_features)
        tensors = [packed.tiles]
    elif packed is not None:
        fields.update(form=FORMS.index("oneDNN packed"))
        tensors = [packed]
    else:
        tensors = [linear.weight]
    if bias is not None:
        fields.update(bias=True)
        tensors.append(bias)
    return [int(v) for v in fields.values()], tensors


def layout_size(layout: list[int]) -> int:
    """How many tensors a weight of this layout travels as."""
    fields = dict(zip(LAYOUT, layout, strict=True))
    if FORMS[fields["form"]] in QUANTIZED:  # codes, scale, minimum?, torch's int4 packing?
        return 2 + fields["minimum"] + 2 * fields["torch_int4"] + fields["bias"]
    return 1 + fields["bias"]


def linear_from_layout(
    layout: list[int], tensors: list[torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """What weight_layout took apart, as x -> x @ weight.T (+ bias) through the same kernel."""
    fields = dict(zip(LAYOUT, layout, strict=True))
    form = FORMS[fields["form"]]
    count = 1
    weight = _NO_WEIGHT
    packed: PackedWeight | None
    if form in QUANTIZED:
        minimum = tensors[2] if fields["minimum"] else None
        count = 2 + fields["minimum"]
        torch_int4 = None
        if fields["torch_int4"]:
            torch_int4 = (tensors[count], tensors[count + 1])
            count += 2
        kernels = torch.ops.folio_quant if fields["folio_kernels"] else None
        packed = QuantizedWeight(
            form, tensors[0], tensors[1], minimum, kernels, torch_int4, bool(fields["dense_bf16"])
        )
    elif form == "dense":
        weight, packed = tensors[0], None
    elif form == "oneDNN packed":
        packed = tensors[0]
    else:
        packed = Bf16Tiles(tensors[0], fields["out_features"], form == "widened bfloat16 tiles")
    bias = tensors[count] if fields["bias"] else None
    return functools.partial(linear, weight=weight, packed=packed, bias=bias)


# A dense weight's placeholder where the packed form is the one read.
_NO_WEIGHT = torch.empty(0)


@functools.cache
def _activation(swiglu: tuple[float, ...]) -> nn.Module:
    """The experts' activation on the CPU (the torch backend's): SiLU, or with (alpha, limit)
    gpt-oss's clamped SwiGLU."""
    backend = TorchAttentionBackend(use_folio_kernels=False)  # its activations hold no state
    return ClampedSwiGLU(backend, *swiglu) if swiglu else SiluAndMul(backend)


def _expert(
    gate_up: Callable[[torch.Tensor], torch.Tensor],
    act: nn.Module,
    down: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
) -> torch.Tensor:
    return down(act(gate_up(x)))


@torch.library.custom_op("folio::moe_experts", mutates_args=())
def _experts_op(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    parts: list[torch.Tensor],
    gate_up: list[int],
    down: list[int],
    first_expert: int,
    swiglu: list[float],
) -> torch.Tensor:
    """run_experts over the experts SparseMoe._op_weights took apart: what compiled programs
    call, the sizes inside depending on the routing."""
    act = _activation(tuple(swiglu))
    gate_up_size = layout_size(gate_up)
    size = gate_up_size + layout_size(down)

    def expert(local: int) -> Callable[[torch.Tensor], torch.Tensor]:
        # Rebuilt when a token goes to it: a decode step reaches a few experts of many.
        at = local * size
        return functools.partial(
            _expert,
            linear_from_layout(gate_up, parts[at : at + gate_up_size]),
            act,
            linear_from_layout(down, parts[at + gate_up_size : at + size]),
        )

    return run_experts(x, weights, ids, first_expert, len(parts) // size, expert)


@_experts_op.register_fake
def _experts_shape(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    parts: list[torch.Tensor],
    gate_up: list[int],
    down: list[int],
    first_expert: int,
    swiglu: list[float],
) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("folio::stacked_experts", mutates_args=())
def _stacked_experts_op(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first_expert: int,
    allow_avx512: bool,
) -> torch.Tensor:
    """folio_moe::experts as compiled programs call it (an op whose output shape dynamo
    knows: x's)."""
    return torch.ops.folio_moe.experts(x, weights, ids, gate_up, down, first_expert, allow_avx512)


@_stacked_experts_op.register_fake
def _stacked_experts_shape(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first_expert: int,
    allow_avx512: bool,
) -> torch.Tensor:
    return torch.empty_like(x)
