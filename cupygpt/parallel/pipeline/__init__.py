"""Pipeline parallelism: schedules as data, their simulator, and the runner."""
