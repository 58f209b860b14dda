"""What the notebooks, the exercises and the course use, kept apart from the engine.

    checkpoints.py        tiny random checkpoints built offline (`make_tiny_model`), to run the engine on
    viz.py                pictures of real engine state: timelines, block maps, acceptance per step
    exercises.py          `check(name, fn)`: a student's answer against the engine, naming the rule broken
    exercise_rules.py     the rules each exercise is about, in words (what a wrong answer or a crash broke)
    references.py         the engine's answer to each exercise
    scheduler_machine.py  the scheduler's hypothesis state machine, for any scheduling policy
    capstone.py           `grade_policy`: the capstone's grader (a scheduling policy)
    policy_behaviour.py   what a policy does under open-loop arrivals: priority, victim, bounded wait, state
    hands_on.py           the hands-on track: assignments, a student's file loaded; grade_hands_on.py grades it
    hands_on_attention.py the graders of a student's attention backend and Triton kernel (probes, then the engine);
    hands_on_sampling.py  of a sampling filter; hands_on_allocator.py of a block allocator
    hf_check.py           `assert_hf_greedy`: the teacher-forced comparison with HF transformers
    tensor_parallel.py    what each rank holds and sends, asked of a running tensor-parallel engine
    step_cost.py          what a decode step costs: timed by the engine's counters, profiled op by op
    cost_viz.py           pictures of those costs: the step split, the costliest ops, the roofline
    measured_words.py     sentences from measured numbers: a share in words, how busy the machine is
    kernel_walkthrough.py the paged-attention kernel's source in pieces, its online softmax replayed
    two_streams.py        notebook 10's two streaming callers, every wait bounded

The dependency goes one way: this package imports the engine, the engine never imports it (checked
by tests/test_layering.py; the one exception is the `minivllm bench` command, which times a tiny
checkpoint when given no model). Reading `minivllm/` outside this folder is reading the engine.
"""
