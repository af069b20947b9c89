"""The chaos suite (``rollart chaos FLOW --scenario NAME|all``): faults injected into real runs on a seeded
schedule, and the proof that nothing is lost or leaked. Scenarios in scenarios.py, the faults in faults.py,
one scenario's run and its checks in runner.py, the table in suite.py."""
