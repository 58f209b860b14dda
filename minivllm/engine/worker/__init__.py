"""The model runner's side: one rank's model loaded and its KV pool sized, a plan packed into one flat
batch (`StepInputs`), the one forward path, sampling, and what makes it fast (warm-up, CUDA graphs).

It imports request/ (the plan in, a `ModelRunnerOutput` back) and spec_decode/'s rejection sampler, never
core/: the runner knows the plan, not the scheduler's books. The executor (executor/) owns the runners."""
