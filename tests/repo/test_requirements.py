"""requirements-neuron.txt = the Neuron packages + requirements.txt minus its CPU torch pin."""

from tests.support import REPO as ROOT



def _pins(name):
    return [ln.strip() for ln in (ROOT / name).read_text().splitlines()
            if ln.strip() and not ln.startswith(("#", "-"))]


def test_neuron_requirements_follow_cpu_requirements():
    cpu = _pins("requirements.txt")
    neuron = _pins("requirements-neuron.txt")
    assert "torch==2.13.0" in cpu
    assert [p for p in cpu if not p.startswith("torch==")] == [p for p in neuron if not p.startswith(
        ("torch==", "torch-neuronx", "neuronx-cc", "nki"))]
    assert any(p.startswith("torch==2.14") for p in neuron)
