"""`python examples/neuron/make_tiny_checkpoint.py ...` runs examples/tools/make_tiny_checkpoint.py
(same script, same options), at the path the design and existing commands name."""
import runpy
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parents[1] / "tools" / "make_tiny_checkpoint.py"
    runpy.run_path(str(script), run_name="__main__")
