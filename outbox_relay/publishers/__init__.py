"""Where messages go: the publisher contract and its loading (``base``), and the built-in
Kafka and HTTP publishers."""
