"""Running rounds: one engine for plain and Streaming DiLoCo.

`engine.RoundEngine` runs a round per fragment schedule (plain DiLoCo is one fragment):
`results` collects what comes back within the straggler window, `pacing` sets adaptive
steps, `sitting_out` tracks late workers and `divergence` tells a diverged run from a bad
round.
"""
