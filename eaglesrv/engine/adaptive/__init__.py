"""Load-adaptive speculation: choose, every step, how much to speculate.

    cost_model.py   measured seconds of target and draft passes (cached per machine)
    acceptance.py   online per-depth, per-rank acceptance; expected accept length of a shape
    policy.py       the per-step choice: plain decoding, a chain or a tree, and for whom
    backlog.py      target features held for requests the draft has not seen yet (FeaturePool)
    controller.py   AdaptiveSpeculation: the shared state above, and what was chosen
    calibrate.py    measuring the cost model at start-up, cached per machine
"""
