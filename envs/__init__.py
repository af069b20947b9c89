"""Environments: plain reset/step objects with text observations and text actions.

Contract: ``reset(seed) -> (observation, info)``;
``step(action) -> (observation, reward, terminated, truncated, info)``; ``close()``.
An env may expose ``action_choices`` (the complete set of legal actions) so an engine
can constrain decoding; it always parses free text itself.
Nothing here imports the runtime.
"""
