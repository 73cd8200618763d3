"""`launch.xla_flags`: the defaults are appended before jax starts, a flag the user set wins, and
`DSV41_XLA_DEFAULTS=0` turns them off; the CPU schedule check reads the flag's last setting."""

from launch import xla_flags


def test_defaults_are_appended_and_a_users_flag_wins():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  flags = xla_flags.apply_defaults(env)
  assert env["XLA_FLAGS"] == flags and flags.startswith("--xla_force_host_platform_device_count=8 ")
  for name, value in {**xla_flags.GPU_DEFAULTS, **xla_flags.CPU_DEFAULTS}.items():
    assert flags.count(f"--{name}=") == 1 and f"--{name}={value}" in flags
  assert xla_flags.cpu_schedule_is_depth_first(env)
  mine = {"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"}
  xla_flags.apply_defaults(mine)
  assert mine["XLA_FLAGS"].count("xla_cpu_enable_concurrency_optimized_scheduler") == 1
  assert not xla_flags.cpu_schedule_is_depth_first(mine)
  off = {"DSV41_XLA_DEFAULTS": "0"}
  assert xla_flags.apply_defaults(off) == "" and "XLA_FLAGS" not in off
  assert not xla_flags.cpu_schedule_is_depth_first(off)


def test_cpu_schedule_reads_the_last_setting():
  check = lambda flags: xla_flags.cpu_schedule_is_depth_first({"XLA_FLAGS": flags})
  name = "--xla_cpu_enable_concurrency_optimized_scheduler"
  assert check(f"{name}=false") and check(f"{name}=true {name}=false") and check(f"{name}=0")
  assert not check(f"{name}=false {name}=true") and not check(name) and not check("")
  assert not check(f"{name}_x=false")
