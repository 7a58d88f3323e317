"""The kernel switches read from the environment (backends/cuda/switches.py): the
defaults, each variable's values, and a clear error for any other (no GPU needed)."""
import pytest

from cupy_llama.backends.cuda.switches import (ENVIRONMENT, FP8_CHOICES, SKINNY_CHOICES,
                                               KernelSwitches)
from cupy_llama.errors import ConfigError


def test_defaults_without_the_variables():
    assert KernelSwitches.from_environment({}) == KernelSwitches()
    assert KernelSwitches().programmatic and KernelSwitches().clusters
    assert KernelSwitches().head_norm_attention


@pytest.mark.parametrize("name", ["programmatic", "clusters", "head_norm_attention"])
def test_on_off_switches(name):
    variable = ENVIRONMENT[name]
    assert getattr(KernelSwitches.from_environment({variable: "0"}), name) is False
    assert getattr(KernelSwitches.from_environment({variable: "1"}), name) is True
    with pytest.raises(ConfigError, match=f"{variable} must be 0 or 1, got 'yes'"):
        KernelSwitches.from_environment({variable: "yes"})


@pytest.mark.parametrize("name, choices", [("skinny_gemm", SKINNY_CHOICES),
                                           ("fp8_gemm", FP8_CHOICES)])
def test_choice_switches(name, choices):
    variable = ENVIRONMENT[name]
    for choice in choices:
        assert getattr(KernelSwitches.from_environment({variable: choice}), name) == choice
    with pytest.raises(ConfigError, match=f"{variable} must be one of {', '.join(choices)}, "
                                          "got 'fast'"):
        KernelSwitches.from_environment({variable: "fast"})
