"""What the benchmarks and the tests share: synthetic inputs (token sequences accepted at a chosen rate, a
character-level tokenizer, short prompts, a tiny workflow project), a fake OpenAI server, and reference
implementations that the optimised code is checked against and timed beside."""
