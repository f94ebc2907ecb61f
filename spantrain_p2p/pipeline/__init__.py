"""Pipeline schedules as data (GPipe, 1F1B, ZB-H1) and, later, the executor that runs them."""
