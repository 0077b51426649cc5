from deepinfer.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
    # Measured (README "Weight formats"): the packed references dequantize every weight on every step,
    # which costs more than these CPUs' dense GEMMs; memory is not the limit on the tiny checkpoints.
    default_weight_format = "dense"
