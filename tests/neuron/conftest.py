"""Neuron host-mode tests: make tests/neuron importable helpers available (neuron_helpers.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
