// cmd.h: the commands of the CLI, `mha <command> ...`. Each is called with
// argv[0] its name and returns the exit status (0; 1 on failure, 2 on a
// usage error) after printing any error on stderr. tools/mha.c dispatches
// to them; a command may run another below it (mha demo runs mha demo
// heads, which runs mha inspect), never one above.
#ifndef MHA_CMD_H
#define MHA_CMD_H

int cmd_init(int argc, char **argv);      // cmd_init.c
int cmd_forward(int argc, char **argv);   // cmd_run.c
int cmd_backward(int argc, char **argv);  // cmd_run.c
int cmd_inspect(int argc, char **argv);   // cmd_inspect.c
int cmd_train(int argc, char **argv);     // train.c (and mha train plot)
int cmd_demo(int argc, char **argv);      // demo.c
int cmd_bench(int argc, char **argv);     // bench.c
int cmd_embed(int argc, char **argv);     // cmd_embed.c (examples/embed)
// mha demo heads (heads.c; argv[0] is "heads"), run by cmd_demo.
int demo_heads(int argc, char **argv);

#endif
