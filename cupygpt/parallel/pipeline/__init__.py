"""Pipeline parallelism: schedules as data, their simulator, the step's plan and its executor."""
