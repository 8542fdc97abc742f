"""Pipeline parallelism: schedules as data, a runner that executes them, transports."""
