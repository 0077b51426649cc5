"""`python examples/neuron/bench_offline.py ...` runs examples/bench/bench_offline.py (same script, same
options), at the path the design and existing commands name."""
import runpy
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parents[1] / "bench" / "bench_offline.py"
    runpy.run_path(str(script), run_name="__main__")
