"""Neuron-side operators: kernel table (NKI on device, references on host), region compilation,
fixed-shape MoE, trn2 fp8 handling and the float8 op guard (design.md §2, neuron.md §3-5).

Nothing here imports torch_neuronx / nki / neuronxcc at module import time."""
