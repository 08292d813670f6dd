// cmd.h: the commands of the CLI, `mha <command> ...`, each called with
// argv[0] the command's name; each returns the exit status (0, 1 on
// failure, 2 on a usage error) after printing any error on stderr.
// tools/mha.c dispatches to them; a command may run another (mha demo
// heads runs mha inspect), never the other way round.
#ifndef MHA_CMD_H
#define MHA_CMD_H

int cmd_init(int argc, char **argv);     // cmd_init.c
int cmd_forward(int argc, char **argv);  // cmd_run.c
int cmd_backward(int argc, char **argv); // cmd_run.c
int cmd_demo(int argc, char **argv);     // demo.c
int cmd_train(int argc, char **argv);    // train.c
int cmd_bench(int argc, char **argv);    // bench.c
// mha inspect (cmd_inspect.c; argv[0] is "inspect"); mha demo heads
// (argv[0] is "heads").
int cmd_inspect(int argc, char **argv);
int demo_heads(int argc, char **argv);   // heads.c

#endif
