"""Neuron-side operators: the kernel table (PyTorch references, as custom ops in host mode, with
the planned NKI kernels listed in kernels.py), layer-region compilation, trn2 fp8 handling and the
float8 op guard.

Nothing here imports torch_neuronx / nki / neuronxcc at module import time."""
