"""Training the demo models here: the stdlib corpus, the tokenizer and LLM, boost-tuned SSMs."""
