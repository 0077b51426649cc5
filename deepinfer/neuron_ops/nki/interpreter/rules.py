"""trn2 (NeuronCore-v3) limits the interpreter enforces, and the error that names a broken rule.

Sizes: SBUF 24 MiB and PSUM 2 MiB per NeuronCore-v3, both split over 128 partitions (AWS Neuron
docs, "Trainium2 Architecture Guide for NKI" and `nki.language.tile_size`): 192 KiB of SBUF and
16 KiB = 8 banks x 2 KiB of PSUM per partition. Tensor Engine limits are those of `nki.isa.nc_matmul`
(contraction on <= 128 partitions, stationary free <= 128, moving free <= 512, fp32 PSUM output).
"""

PARTITIONS = 128
SBUF_BYTES_PER_PARTITION = 192 * 1024
PSUM_BANK_BYTES = 2 * 1024
PSUM_BANKS = 8
MATMUL_CONTRACTION_MAX = 128
MATMUL_STATIONARY_FREE_MAX = 128
MATMUL_MOVING_FREE_MAX = 512
TRANSPOSE_TENSOR_ENGINE_MAX = 128  # nc_transpose on the Tensor Engine: both sides <= 128
TRANSPOSE_VECTOR_ENGINE_MAX = 32   # nc_transpose on the Vector Engine: 32 x 32 blocks
LNC_MAX = 2                        # trn2: a logical core is at most 2 physical cores

# rule id -> the sentence every violation of it carries
RULES = {
    "partition-dim": f"an on-chip tile's partition dim (axis 0) must be <= {PARTITIONS}",
    "matmul-contraction": f"nc_matmul contracts over the partition dim, which must be <= {MATMUL_CONTRACTION_MAX} "
                          "and equal for stationary and moving",
    "matmul-stationary-free": f"nc_matmul stationary free size must be <= {MATMUL_STATIONARY_FREE_MAX}",
    "matmul-moving-free": f"nc_matmul moving free size must be <= {MATMUL_MOVING_FREE_MAX}",
    "matmul-output-fp32-psum": "nc_matmul writes fp32 into PSUM; accumulate its result only into an fp32 PSUM tile",
    "matmul-inputs-sbuf": "nc_matmul reads stationary and moving from SBUF",
    "no-fp4-matmul": "trn2 has no fp4/integer matmul: dequantize uint8 codes on the Vector Engine "
                     "into bf16 (or use fp8) before nc_matmul",
    "psum-banks": f"at most {PSUM_BANKS} PSUM banks of {PSUM_BANK_BYTES} bytes per partition may be live",
    "sbuf-budget": f"live SBUF tiles may use at most {SBUF_BYTES_PER_PARTITION} bytes per partition",
    "dma-hbm-sbuf": "loads and stores move data only between HBM and SBUF (no HBM<->PSUM, no SBUF<->SBUF)",
    "compute-on-chip": "compute instructions read and write SBUF/PSUM tiles, never HBM tensors",
    "transpose-size": "nc_transpose: Tensor Engine tiles <= 128 x 128, Vector Engine tiles <= 32 x 32",
    "lnc": f"an SPMD launch over logical cores (nl.nc(n)) has n <= {LNC_MAX} program ids on trn2",
    "bitvec-int": "bitvec operators (and, or, shifts) take integer tiles only",
    "shape": "operand shapes must match (or broadcast a (P, 1) vector along the free dims)",
    "register-host": "a VirtualRegister's value exists only on the device: it bounds nl.dynamic_range or offsets a "
                     "DMA, it never steers Python control flow or becomes a Python int",
    "register-load": "register_load reads a 1x1 int32 tile in SBUF into a VirtualRegister",
    "dynamic-range-step": "nl.dynamic_range takes a compile-time positive int step (bounds may be registers)",
    "dynamic-offset": "a register offsets the outermost axis of an HBM tensor, as the start address of a DMA",
    "dma-oob": "a DMA at a dynamic offset outside its tensor is a runtime error unless oob_mode.skip skips it",
}


class NkiRuleError(ValueError):
    """A kernel broke a trn2 rule; `rule` is the id in RULES, the message starts with it."""

    def __init__(self, rule: str, detail: str):
        self.rule = rule
        super().__init__(f"[trn2 rule {rule}] {RULES[rule]}: {detail}")


def require(ok: bool, rule: str, detail: str) -> None:
    if not ok:
        raise NkiRuleError(rule, detail)
