"""Per-agent device layout: disjoint when disaggregated, shared when colocated."""

import jax
import pytest

from flexmarl_jax.mesh.layout import layout_devices


def test_disaggregated_layout_is_disjoint_and_complete():
    devices = jax.devices()
    layout = layout_devices(devices, ["a", "b", "c"], instances_per_agent=1, rollout_devices_per_instance=1,
                            train_devices_per_agent=1)
    used = [d for agent in layout.values() for group in (*agent.rollout_groups, agent.train_devices) for d in group]
    assert len(used) == 6 and len(set(used)) == 6
    assert layout["b"].train_mesh().devices.size == 1
    two = layout_devices(devices, ["a", "b"], instances_per_agent=2, rollout_devices_per_instance=1,
                         train_devices_per_agent=2)
    assert two["a"].train_mesh().shape == {"fsdp": 2, "tp": 1}
    assert two["b"].train_mesh(tp=2).shape == {"fsdp": 1, "tp": 2}
    assert len(two["a"].rollout_groups) == 2 and two["a"].rollout_groups[0] != two["a"].rollout_groups[1]


def test_colocated_layout_reuses_training_devices():
    layout = layout_devices(jax.devices(), ["a", "b"], instances_per_agent=2, rollout_devices_per_instance=1,
                            train_devices_per_agent=2, colocate=True)
    assert layout["a"].rollout_groups == (layout["a"].train_devices,) * 2
    assert not set(layout["a"].train_devices) & set(layout["b"].train_devices)


def test_a_lora_groups_agents_share_their_leaders_rollout_devices():
    """b and c ride on a's rollout groups (one LoRA base group): two rollout devices for the group, two for d, and
    each of the four agents its own training device, 8 in all, disjoint apart from the shared rollout groups."""
    leaders = {"a": "a", "b": "a", "c": "a"}
    layout = layout_devices(jax.devices(), ["a", "b", "d", "c"], instances_per_agent=2, rollout_devices_per_instance=1,
                            train_devices_per_agent=1, rollout_leaders=leaders)
    assert layout["b"].rollout_groups == layout["c"].rollout_groups == layout["a"].rollout_groups
    assert not set(layout["d"].rollout_groups) & set(layout["a"].rollout_groups)
    rollout = {d for agent in ("a", "d") for group in layout[agent].rollout_groups for d in group}
    train = [d for agent in layout.values() for d in agent.train_devices]
    assert len(rollout) == 8 - 4 == len(set(train)) and not rollout & set(train)
    with pytest.raises(ValueError, match=r"needs 12 devices \(4 agents x 5, 2 of them on their LoRA group's"):
        layout_devices(jax.devices(), ["a", "b", "d", "c"], instances_per_agent=2, rollout_devices_per_instance=2,
                       train_devices_per_agent=1, rollout_leaders=leaders)


def test_too_many_devices_requested():
    with pytest.raises(ValueError, match="needs 12 devices"):
        layout_devices(jax.devices(), ["a", "b", "c", "d"], instances_per_agent=1, rollout_devices_per_instance=1,
                       train_devices_per_agent=2)


def test_shared_layout_wraps_agents_around_few_devices():
    """mesh.colocate: one device serves a whole team; with more devices agents take them in turn."""
    one = layout_devices(jax.devices()[:1], ["a", "b", "c"], instances_per_agent=2, rollout_devices_per_instance=1,
                         train_devices_per_agent=1, share_between_agents=True)
    device = jax.devices()[0]
    assert all(agent.train_devices == (device,) and agent.rollout_groups == ((device,),) * 2 for agent in one.values())
    three = layout_devices(jax.devices()[:3], ["a", "b", "c", "d"], instances_per_agent=1,
                           rollout_devices_per_instance=1, train_devices_per_agent=2, share_between_agents=True)
    assert [three[name].train_devices for name in "abcd"] == [tuple(jax.devices()[0:2]), tuple(jax.devices()[0:2]),
                                                              tuple(jax.devices()[0:2]), tuple(jax.devices()[0:2])]
    with pytest.raises(ValueError, match="needs 2 devices"):
        layout_devices(jax.devices()[:1], ["a"], instances_per_agent=1, rollout_devices_per_instance=1,
                       train_devices_per_agent=2, share_between_agents=True)


def test_devices_alternate_between_processes_so_instances_and_slices_spread_over_hosts():
    from collections import namedtuple

    from flexmarl_jax.mesh.layout import interleave_processes, layout_devices

    Device = namedtuple("Device", "id process_index")
    devices = [Device(i, i // 4) for i in range(8)]  # 2 processes x 4 devices, in JAX's global order
    ordered = interleave_processes(devices)
    assert [d.id for d in ordered] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert interleave_processes(devices[:4]) == devices[:4]  # one process: unchanged
    layout = layout_devices(ordered, ["solver", "verifier", "corrector"], instances_per_agent=2,
                            rollout_devices_per_instance=1, train_devices_per_agent=0)
    for agent in layout.values():  # every agent has an instance on each process
        assert sorted(group[0].process_index for group in agent.rollout_groups) == [0, 1]
    used = {group[0] for agent in layout.values() for group in agent.rollout_groups}
    free = [d for d in ordered if d not in used]
    assert {d.process_index for d in free[:2]} == {0, 1}  # a training slice of two devices spans both
