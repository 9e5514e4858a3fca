"""The IR rewrites of `hlopar-reroll-stage-loops` (passes/reroll_stage_loops.py): rolling a
run of identical iterations into a while (`rolling`), holding a stage's layer range as one
value (`held_ranges`), computing an update once on a whole range (`widening`), and the
stablehlo builders and readers of a stack's rows they share (`rows`).
"""
