"""Environments: plain reset/step objects with text observations and text actions.

Contract: ``reset(seed) -> (observation, info)``;
``step(action) -> (observation, reward, terminated, truncated, info)``; ``close()``.
An env may expose ``action_choices`` (the complete set of legal actions) so an engine
can constrain decoding; it always parses free text itself. An env may also expose
``expert_action()`` (the action an expert takes in the current state, None when it has
none): the runtime's optional warm start imitates it before RL begins.
Nothing here imports the runtime.
"""
