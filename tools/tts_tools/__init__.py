"""Tools around the runtime (an extra: `pip install -e '.[tools]'`): the TPS benchmark, the load
test and soak, the evaluation. Nothing in tts/, graphs/ or service/ imports them."""
