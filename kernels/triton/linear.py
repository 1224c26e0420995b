"""The Triton kernel's one-projection form (the kernel spec's ``linear_impl``): a model's dense linear (attention,
shared experts, dense MLPs) stored in a scheme the MoE kernel runs, held packed as one expert of the experts'
layout (:class:`~moe_registry_kernels.triton.layout.TritonWeightLayout`) and run by the experts' own GEMM kernel
as one expert that every row is routed to: at decode, the layer's attention reads its 4- or 8-bit codes instead
of a 16-bit copy dequantised at load.

The call is one custom op (``moe_registry::linear``), opaque to torch.compile and capturable in a CUDA graph (it
reads nothing back from the device), and one GEMM launch (after the activations' quantisation, where the key
quantises them). A decode step replays every kernel of every layer from one CUDA graph, and each kernel there
costs its launch on the GPU and on the host whatever its size (a step of a 24-layer model on an H200 spends more
than half its time between kernels): so no alignment, fill or split-K sum launches here. The row blocks come from
a table the linear holds (:class:`RowTable`), and the column tiles are narrowed instead of splitting K.
"""

import torch
import triton

from moe_registry.core.keys import QuantKey
from moe_registry.formats.weights import ProjectionWeights
from moe_registry.layer.linear import Linear

from .fp8_act import FP8_DYNAMIC_MODES
from .launch import _gemm, _Rows
from .layout import TritonWeightLayout, _Proj, mx_scale_codes
from .plan import _codes_dtype, _input_row_sums, _quantize
from .tile_config import _device_name, _fit_config, _num_sms, get_config
from .variant import variant_from_keys

# rows a linear's table covers at first (decode batches, short prefills); a longer call grows it
TABLE_ROWS = 1024
# past this many rows (block_m aligned) "every block's rows are aligned" holds for any call: the table's last value
_ALL_ROWS = 1 << 30


class RowTable:
    """The standard format's row-block tensors for one expert every row goes to, made once: ``sorted_ids`` 0, 1,
    2, ... (a block's rows past the call's ``num_valid`` are masked by it), ``expert_ids`` zeros, and a
    ``num_post_padded`` past any call's blocks; a call takes slices (views, no launch) of the rows it has."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.table = torch.cat([torch.arange(rows, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
                                torch.tensor([_ALL_ROWS], dtype=torch.int32)]).to(device)

    @staticmethod
    def rows_for(table: torch.Tensor) -> int:
        return (table.numel() - 1) // 2

    @staticmethod
    def slices(table: torch.Tensor, m: int, block_m: int) -> _Rows:
        """The row blocks of ``m`` rows in blocks of ``block_m`` (``table`` must hold that many padded rows)."""
        rows = RowTable.rows_for(table)
        blocks = triton.cdiv(m, block_m)
        if m == 1:  # one row: one block, its expert straight from the table
            return _Rows(expert_ids=table[rows:rows + 1], num_valid=1, one_pair_blocks=True)
        return _Rows(table[:blocks * block_m], table[rows:rows + blocks], table[-1:], num_valid=m)


def _one_projection(w: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                    perm: torch.Tensor | None, input_scale: torch.Tensor | None, scale2: torch.Tensor | None,
                    mx_scale_codes: list[int] | None, packed: bool) -> _Proj:
    k = w.shape[2] * (2 if packed else 1)
    codes = (mx_scale_codes[0], mx_scale_codes[1]) if mx_scale_codes is not None else None
    return _Proj(w, scale, zero, perm, None, input_scale, w.shape[1], k, scale2, codes)


def _tile(m: int, w: _Proj, weight_key: str, activation_key: str, device: torch.device) -> dict:
    """The experts' default tile for one expert and top-1 (tuned tables hold MoE shapes), K left whole: where
    the default would split K to fill the SMs, its column tiles are narrowed instead (down to 32 columns)."""
    variant = variant_from_keys(weight_key, activation_key)
    config = get_config(m, 1, 1, w.n, w.k, weight_key, activation_key, _device_name(device), _num_sms(device),
                        warn=False)
    if config["SPLIT_K"] > 1:
        config["BLOCK_N"] = max(32, config["BLOCK_N"] // config["SPLIT_K"])
    return _fit_config(config, variant, can_split=False)


def _linear(x: torch.Tensor, w: _Proj, weight_key: str, activation_key: str, table: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the one expert's projection: [M, N] in x's dtype; ``table``: the linear's RowTable."""
    variant = variant_from_keys(weight_key, activation_key)
    m, dt, dev = x.shape[0], x.dtype, x.device
    out = torch.empty(m, w.n, dtype=dt, device=dev)
    if m == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    config = _tile(m, w, weight_key, activation_key, dev)
    if triton.cdiv(m, config["BLOCK_M"]) * config["BLOCK_M"] > RowTable.rows_for(table):
        raise ValueError(f"the linear's row table holds {RowTable.rows_for(table)} rows, the call has {m}")
    rows = RowTable.slices(table, m, config["BLOCK_M"])
    if variant.act_quant in FP8_DYNAMIC_MODES:
        a, a_scale = _quantize(x, variant, None)
    else:
        a, a_scale = _quantize(x, variant, w.input_scale, **_codes_dtype(variant, config, dt))
    _gemm(a, a_scale, w, variant, out, rows, config, compute_dtype=dt,
          row_sums=_input_row_sums(a, config, w, variant, rows, False))
    return out


@torch.library.custom_op("moe_registry::linear", mutates_args=())
def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
           perm: torch.Tensor | None, input_scale: torch.Tensor | None, table: torch.Tensor, weight_key: str,
           activation_key: str, scale2: torch.Tensor | None = None,
           mx_scale_codes: list[int] | None = None) -> torch.Tensor:
    """x [M, K] times one projection held as TritonWeightLayout packs it (weight [1, N, K']), keys as QuantKey
    strings: [M, N] in x's dtype; ``table``: a RowTable's tensor covering M rows (block-padded)."""
    variant = variant_from_keys(weight_key, activation_key)
    proj = _one_projection(w, scale, zero, perm, input_scale, scale2, mx_scale_codes, variant.packed)
    return _linear(x, proj, weight_key, activation_key, table)


@linear.register_fake
def _(x, w, *args, **kwargs):
    return x.new_empty(x.shape[0], w.shape[1])


class TritonLinear(Linear):
    """A dense linear on the Triton MoE GEMM, as one expert's projection (see the module)."""

    def __init__(self, weights: ProjectionWeights, weight_key: QuantKey, activation_key: QuantKey) -> None:
        super().__init__(weights, weight_key, activation_key)
        if weights.weight.shape[0] != 1:
            raise ValueError(f"the Triton linear takes one projection, got weight {list(weights.weight.shape)}")
        self._keys = str(weight_key), str(activation_key)
        variant = variant_from_keys(*self._keys)  # raises early if the kernel has no variant for the keys
        weight, scale, zero, perm, _bias, input_scale = TritonWeightLayout(variant).pack(weights)
        self._tensors = (weight, scale, zero, perm, input_scale)
        self._scale2 = (None if weights.scale2 is None
                        else weights.scale2.reshape(1, -1).to(torch.float32).contiguous())
        self._codes = mx_scale_codes(weights, variant)
        self._rows = RowTable(TABLE_ROWS, weight.device)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] + 256 > self._rows.rows and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            # (a capture keeps the table it has: a call past it raises, with the counts)
            self._rows = RowTable(triton.next_power_of_2(x.shape[0] + 256), x.device)
        return linear(x, *self._tensors, self._rows.table, *self._keys, self._scale2, self._codes)

    def resident_weight_bytes(self) -> int:
        held = [*self._tensors, self._scale2]
        return sum(t.numel() * t.element_size() for t in held if t is not None)
