"""Agent-client programs: each drives one library's tool loop against a batchserve URL given on its command line
(`python -m clients.NAME BASE_URL MODEL [SCENARIO ...]`, run from tests/api/agents) and prints one JSON line per
scenario. They import neither batchserve nor the test suite, so they run as any user's program would."""
