"""MQTT 3.1.1 / 5 conformance: paho-mqtt and raw-socket scenarios run
against a reference broker (Mosquitto) and a candidate (Weir)."""
