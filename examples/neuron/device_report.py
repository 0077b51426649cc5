"""Every graph the default Neuron serving config compiles, traced at full shapes on meta under the fake
process group, with each rank's HBM bytes, a decode step's eager ops and copies, and the device rules
(deepinfer/tools/device_report.py; nothing runs on a device):

    python examples/neuron/device_report.py --config examples/configs/v41-flash.json --cp 64 --ep 64 \
        [--nextn 5] [--json OUT]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from deepinfer.tools.device_report import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
