"""pytest plugin: ``pytest --kvbuffer-impl module:attr`` validates an outside implementation as tests.

Registered through the ``pytest11`` entry point (pyproject.toml), so installing kvbuffer makes the
options available in any project; without ``--kvbuffer-impl`` it does nothing (and imports nothing
heavy).  Each lane of ``kvbuffer validate`` (operation x implementation x dtype) becomes one test
item named ``kvbuffer[<impl>-<op>-<dtype>]``; operations the adapter does not provide become skipped
items that say why.  A failing item prints the smallest failing case, the comparisons against the
tolerance table, and how to replay it.

Options: --kvbuffer-impl (repeatable), --kvbuffer-ops, --kvbuffer-dtype, --kvbuffer-device,
--kvbuffer-profile (ci | thorough), --kvbuffer-seed, --kvbuffer-max-examples.  Select or deselect
items with ``-k kvbuffer``.  Without CUDA the Triton interpreter is enabled (TRITON_INTERPRET=1) when
pytest configures, which is before your tests import triton, unless a conftest imported it earlier.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("kvbuffer", "validate a gated-delta-rule implementation against the KVBuffer oracle")
    group.addoption("--kvbuffer-impl", action="append", default=None, metavar="MODULE:ATTR",
                    help="adapter to validate (repeatable); also: reference, fast, fla")
    group.addoption("--kvbuffer-ops", default=None, metavar="OPS", help="comma list of operations (default all)")
    group.addoption("--kvbuffer-dtype", default=None, metavar="DTYPES",
                    help="comma list of dtypes (default: float64/float32 as the adapter declares)")
    group.addoption("--kvbuffer-device", default=None, choices=("cpu", "cuda"),
                    help="device of the inputs (default: cuda when available)")
    group.addoption("--kvbuffer-profile", default=None, choices=("ci", "thorough"),
                    help="hypothesis profile (default: $HYPOTHESIS_PROFILE or ci)")
    group.addoption("--kvbuffer-seed", default=None, type=int, help="seed of the random cases (default: fresh)")
    group.addoption("--kvbuffer-max-examples", default=None, type=int, metavar="N", help="examples per lane")


def _active(config) -> bool:
    return bool(config.getoption("kvbuffer_impl"))


def pytest_configure(config):
    config.addinivalue_line("markers", "kvbuffer: a lane of kvbuffer validate (added by --kvbuffer-impl)")
    if not _active(config):
        return
    import torch

    device = config.getoption("kvbuffer_device") or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--kvbuffer-device cuda: CUDA is not available on this machine")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    config._kvbuffer_device = device


def pytest_report_header(config):
    if _active(config):
        return [f"kvbuffer: validating {', '.join(config.getoption('kvbuffer_impl'))} on "
                f"{getattr(config, '_kvbuffer_device', '?')}"]
    return None


class KvbufferFailure(Exception):
    """A failing lane; its message is the validator's failure report."""


class KvbufferItem(pytest.Item):
    def __init__(self, *, lane, spec, options, **kw):
        super().__init__(**kw)
        self.lane = lane
        self.spec = spec
        self.options = options
        self.add_marker(pytest.mark.kvbuffer)

    def runtest(self):
        from .validate import report, runner  # here, not at the top: see the module's docstring

        lane, o = self.lane, self.options
        if lane.status != "RUN":
            pytest.skip(f"{lane.status.lower()}: {lane.reason}")
        lane.impl.prepare()
        r = runner.run_lane(lane, device=o["device"], profile=o["profile"], seed=o["seed"],
                               max_examples=o["max_examples"], shrink=True, replay=None)
        self.user_properties.append(("kvbuffer", report.table_row(r)))
        if r.failed:
            cmd = report.replay_command(r, self.spec, o["seed"], o["profile"], o["device"])
            raise KvbufferFailure(report.format_failure(r, cmd))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, KvbufferFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, self.name


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    if not _active(config):
        return
    import random

    from . import implementations  # here, not at the top: see the module's docstring
    from .validate import adapters, lanes
    from .validate.profiles import PROFILES, register_profiles

    try:
        ops = lanes.select_ops(config.getoption("kvbuffer_ops"))
        dtypes = lanes.parse_dtypes(config.getoption("kvbuffer_dtype"))
        impls = [(implementations.resolve(spec), spec) for spec in config.getoption("kvbuffer_impl")]
        profile = config.getoption("kvbuffer_profile") or os.environ.get("HYPOTHESIS_PROFILE", "ci")
        if profile not in PROFILES:
            raise ValueError(f"HYPOTHESIS_PROFILE: expected one of {PROFILES}, got {profile!r}")
        register_profiles()
    except (adapters.AdapterError, lanes.ValidationError, ValueError) as e:
        raise pytest.UsageError(f"kvbuffer: {e}") from None
    seed = config.getoption("kvbuffer_seed")
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    options = dict(device=config._kvbuffer_device, profile=profile, seed=seed,
                   max_examples=config.getoption("kvbuffer_max_examples"))
    for impl, spec in impls:
        for lane in lanes.plan([impl], ops, dtypes, options["device"]):
            dt = lanes.dtype_name(lane.dtype) if lane.dtype is not None else "any"
            name = f"kvbuffer[{impl.name}-{lane.op.name}-{dt}]".replace(" ", "_")
            items.append(KvbufferItem.from_parent(session, name=name, lane=lane, spec=spec, options=options))
    config._kvbuffer_seed = seed


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _active(config) and hasattr(config, "_kvbuffer_seed"):
        terminalreporter.write_line(f"kvbuffer: seed {config._kvbuffer_seed} (replay with --kvbuffer-seed "
                                    f"{config._kvbuffer_seed})")
