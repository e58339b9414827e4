#!/bin/bash
# harbor's verifier runs this from the working directory; the reward goes to /logs/verifier/reward.txt.
if [ "$(cat /app/answer.txt 2>/dev/null)" = "hello harbor" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
