"""Tool calling on chat completions: ``spec`` (the request's ``tools``/``tool_choice`` checked, and the
grammar a forced choice imposes) and ``parse`` (the model's text turned into OpenAI ``tool_calls``)."""
