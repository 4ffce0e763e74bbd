"""The placement plan of a disaggregated stack on a small host: the decoding engine (the PD's, the
decode's) alone on the last CPU, the other services on the others, the encoders everywhere at the
lowest priority."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.launch.placement import ENCODER_NICE, Placement
from libs.launch.stack import Stack, StackSpec

pytestmark = pytest.mark.unit


def test_the_engine_gets_the_last_cpu_alone_and_the_services_the_rest() -> None:
    plan = Placement.for_host({0, 1, 2, 3})
    assert plan.engine_cpus == {3}
    assert plan.args("pd") == ["--engine-cpus", "3"]
    for role in ("pd", "router", "openai_door"):
        assert plan.cpus(role) == {0, 1, 2}
        assert plan.nice(role) == 0
    assert plan.args("router") == ["--max-running", "32"]  # one batch of the PD's 8 decoding, three preparing
    assert plan.args("openai_door") == []


def test_in_e_p_d_the_decode_engine_is_alone_and_the_prefill_beside_the_services() -> None:
    plan = Placement.for_host({0, 1}, layout="e/p/d")
    assert plan.args("decode") == ["--engine-cpus", "1"]
    assert plan.args("prefill") == []  # its engine stays with its service
    for role in ("prefill", "decode", "router"):
        assert plan.cpus(role) == {0}
    assert plan.args("router") == ["--max-running", "32"]


def test_the_colocated_layout_has_no_plan() -> None:
    with pytest.raises(ValueError, match="e\\+pd and e/p/d layouts, not 'colocated'"):
        Placement.for_host({0, 1}, layout="colocated")


def test_encoders_run_everywhere_at_the_lowest_priority() -> None:
    plan = Placement.for_host({0, 1})
    assert plan.cpus("encoder") is None
    assert plan.nice("encoder") == ENCODER_NICE == 19
    assert plan.args("encoder") == []


def test_one_cpu_cannot_be_split() -> None:
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        Placement.for_host({5})


@pytest.mark.parametrize("layout", ["e/p/d", "e+pd", "colocated"])
def test_a_stack_refuses_placement_where_it_was_not_planned(layout: str) -> None:
    with pytest.raises(ValueError, match="placement is planned for E\\+PD and E/P/D on vLLM"):
        Stack(StackSpec(layout=layout, engine="reference", placement=True, model=Path("var/models/none")))


def test_a_stack_refuses_placement_of_several_decoding_engines() -> None:
    with pytest.raises(ValueError, match="one decoding engine"):
        Stack(StackSpec(layout="e/p/d", engine="vllm", decodes=2, placement=True, model=Path("var/models/none")))
