"""pdserve: disaggregated prefill/decode LLM serving. The command line is ``pdserve.cli``."""
