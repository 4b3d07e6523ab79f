"""Child processes that fake their own CPU device count keep every other XLA flag of their parent."""

from flexmarl_jax.mesh.host_devices import without_fake_cpu_devices


def test_only_the_device_count_is_dropped():
    parent = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_use_fusion_emitters=false",
              "HOME": "/h"}
    child = without_fake_cpu_devices(parent)
    assert child == {"XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false", "HOME": "/h"}
    assert parent["XLA_FLAGS"].startswith("--xla_force_host_platform_device_count=8")  # the parent's is untouched


def test_no_flags_left_means_no_variable():
    assert without_fake_cpu_devices({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}) == {}
    assert without_fake_cpu_devices({"PATH": "/bin"}) == {"PATH": "/bin"}
