"""DEEPINFER_LOG_LEVEL: the level of the deepinfer loggers, applied at `import deepinfer`, without
taking over an application's logging setup. Each case runs in a fresh interpreter, because the
level is applied once at import."""
import os
import subprocess
import sys

import pytest

from tests.support import REPO as ROOT

# Logs through a module logger of the package, as deepinfer's own modules do.
PROBE = """
import logging, sys
{setup}
import deepinfer
{after}
log = logging.getLogger("deepinfer.worker.worker")
log.debug("probe-debug")
log.info("probe-info")
log.warning("probe-warning")
"""


def _run(level: str | None, setup: str = "", after: str = "") -> str:
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_LOG_LEVEL"}
    if level is not None:
        env["DEEPINFER_LOG_LEVEL"] = level
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", PROBE.format(setup=setup, after=after)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stderr


def _lines(stderr: str) -> list[str]:
    return [ln.split(": ", 1)[1] for ln in stderr.splitlines() if ": probe-" in ln]


def test_debug_shows_debug_messages():
    assert _lines(_run("DEBUG")) == ["probe-debug", "probe-info", "probe-warning"]


def test_warning_hides_info_messages():
    assert _lines(_run("WARNING")) == ["probe-warning"]


def test_unset_means_info():
    assert _lines(_run(None)) == ["probe-info", "probe-warning"]


def test_application_handlers_get_each_record_once():
    # The application's basicConfig (root at WARNING) comes first; deepinfer's level still decides
    # which deepinfer records pass, and they print once, through the application's handler.
    setup = "logging.basicConfig(level=logging.WARNING, format='APP %(name)s: %(message)s')"
    stderr = _run("DEBUG", setup=setup)
    assert _lines(stderr) == ["probe-debug", "probe-info", "probe-warning"]
    assert all(ln.startswith("APP deepinfer.worker.worker") for ln in stderr.splitlines() if "probe-" in ln)


def test_application_config_after_import_is_not_doubled():
    stderr = _run("INFO", after="logging.basicConfig(format='APP %(name)s: %(message)s')")
    probes = [ln for ln in stderr.splitlines() if "probe-" in ln]
    assert probes == ["APP deepinfer.worker.worker: probe-info", "APP deepinfer.worker.worker: probe-warning"]


def test_an_explicit_level_overrides_the_variable():
    # What a server's --log-level does.
    after = "from deepinfer.logging_config import configure_logging; configure_logging('warning')"
    assert _lines(_run("DEBUG", after=after)) == ["probe-warning"]


def test_bad_level_is_rejected():
    from deepinfer.logging_config import configure_logging
    with pytest.raises(ValueError, match="log level"):
        configure_logging("loud")
