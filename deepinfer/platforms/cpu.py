from deepinfer.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    dist_backend = "gloo"
