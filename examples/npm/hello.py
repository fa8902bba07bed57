def main(args):
    print("hello from the GPU runtime")
    return {"greeting": "Hello " + args.get("name", "world")}
