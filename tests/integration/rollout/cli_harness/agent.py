"""A small CLI agent harness, standard library only, as a team would install it in an image: it asks the
OpenAI-compatible endpoint it is given (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``), streamed, runs the ``bash`` tool
calls it gets and sends their output back, and prints the final answer when an answer has no tool call. The task
is ``AGENTENV_TASK``. It knows nothing of agentenv."""

import json
import os
import subprocess
import sys
import urllib.request

BASE, KEY, TASK = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["AGENTENV_TASK"]
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def ask(messages):
    body = json.dumps({"model": "gpt-4o", "messages": messages, "tools": TOOLS, "stream": True}).encode()
    req = urllib.request.Request(BASE + "/chat/completions", data=body, method="POST",
                                 headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
    content, calls = "", {}
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if not chunk.get("choices"):
                continue
            delta = chunk["choices"][0]["delta"]
            content += delta.get("content") or ""
            for c in delta.get("tool_calls") or []:
                call = calls.setdefault(c["index"], {"id": c.get("id"), "type": "function",
                                                     "function": {"name": c["function"]["name"], "arguments": ""}})
                call["function"]["arguments"] += c["function"].get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def main():
    messages = [{"role": "user", "content": TASK}]
    for _ in range(6):
        content, calls = ask(messages)
        messages.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
        if not calls:
            print(content)
            return 0
        for c in calls:
            command = json.loads(c["function"]["arguments"]).get("command", "")
            out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=30)
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": out.stdout + out.stderr})
    return 3


if __name__ == "__main__":
    sys.exit(main())
