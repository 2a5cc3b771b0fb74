"""An agent loop over `smollm2 serve`'s tool calls, with the official openai client.

    smollm2 serve &
    python examples/agent.py ["What is the weather in Paris, in Fahrenheit?"]

The task needs two tools, implemented here in Python: get_weather (a city's temperature in degrees Celsius) and
convert_temperature (Celsius to Fahrenheit). Each round asks the model for calls with tool_choice="required",
runs them, and sends their results back as "tool" messages; once both tools have answered, the model is asked
what they found. Each round offers only the tools not called yet, so that every round moves the task on (a
small model may otherwise make the same call again).
"""

from __future__ import annotations

import argparse
import json

from openai import OpenAI

TEMPERATURES = {"paris": 18.0, "london": 12.5, "tokyo": 24.0, "new york": 21.0}  # degrees Celsius


def get_weather(city: str) -> dict:
    return {"city": city, "celsius": TEMPERATURES.get(city.strip().lower(), 15.0)}


def convert_temperature(celsius: float) -> dict:
    return {"celsius": celsius, "fahrenheit": round(celsius * 9 / 5 + 32, 1)}


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current temperature in a city, in degrees Celsius",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert_temperature", "description": "Convert a temperature from degrees Celsius to Fahrenheit",
        "parameters": {"type": "object", "properties": {"celsius": {"type": "number"}}, "required": ["celsius"]}}},
]
RUN = {"get_weather": get_weather, "convert_temperature": convert_temperature}


def agent(client: OpenAI, model: str, question: str) -> tuple[str, list[tuple[str, dict]]]:
    """The model's answer to `question`, and the calls it made on the way: (name, arguments) each."""
    messages, calls = [{"role": "user", "content": question}], []
    while len(calls) < len(TOOLS):
        offered = [tool for tool in TOOLS if tool["function"]["name"] not in {name for name, _ in calls}]
        message = client.chat.completions.create(model=model, messages=messages, tools=offered,
                                                 tool_choice="required", temperature=0).choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the assistant's calls, for the next round
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            result = RUN[call.function.name](**arguments)
            print(f"{call.function.name}({call.function.arguments}) -> {json.dumps(result)}")
            calls.append((call.function.name, arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    messages.append({"role": "user", "content": "What did the tools find? Answer in one sentence."})
    answer = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=80)
    return answer.choices[0].message.content, calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What is the weather in Paris, in Fahrenheit?")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args(argv)
    client = OpenAI(base_url=args.base_url, api_key="unused")
    answer, _ = agent(client, args.model, args.question)
    print(answer)


if __name__ == "__main__":
    main()
